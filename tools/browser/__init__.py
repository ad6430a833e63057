"""The `browser` tool: search, open and find, over Exa or a local folder of documents.

`server.py` is the tool server, `session.py` one response's browsing, `backend.py` the search
backends' interface (`exa_backend.py`, `local_backend.py`), `page.py` a page as the model sees
it, `citations.py` and `citation_stream.py` the model's citation marks turned into links.
"""
