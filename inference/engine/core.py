"""The serving engine: many concurrent requests sharing one model and one paged KV cache.

`LLMEngine` is the synchronous core, driven one `step()` at a time (tests drive it directly):

    engine = LLMEngine.from_pretrained(model_dir, num_pages=256)
    engine.add_request(GenerationRequest("a", prompt_ids, SamplingParams(temperature=0)))
    while engine.has_unfinished():
        for delta in engine.step(): ...

Each step: the scheduler picks sequences and token counts, the model runner runs them and
samples, and the engine appends tokens, checks stop conditions, and turns results into
`TokenDelta`s. A request with a grammar (`SamplingParams.grammar`, `inference/grammar.py`) waits
outside the scheduler while its grammar compiles on the compiler's thread, then runs like any
other, its grammar advanced with each token it keeps (drafts included: a drafter's proposals are
cut where the grammar refuses them). With async scheduling (`inference/scheduling/async_scheduling.py`) the next step,
where it is plain decode, is launched before this step's tokens are read, so that host work
overlaps the device.

Who drives it: `EngineDriver` (`driver.py`) is the loop between steps; `AsyncEngine`
(`async_engine.py`, a thread) and `EngineProcess` (`process.py`, a process of its own) run that
loop and stream each request's deltas to asyncio consumers (`client.py`, the `EngineClient`
protocol of `inference/request.py`). With tensor parallelism the other ranks are worker
processes that `executor.py` starts and owns.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from inference.config import EngineConfig, ModelConfig
from inference.device import make_device_current
from inference.engine import executor
from inference.engine.step_clock import StepClock
from inference.grammar import GrammarCompiler
from inference.model.gpt_oss import GptOssModel
from inference.ops.attention.reference import FP8_KV_DTYPE
from inference.request import EngineStats, GenerationRequest, TokenDelta, check_request
from inference.runner.model_runner import LaunchedStep, ModelRunner
from inference.runner.single_sequence import SingleSequenceCache
from inference.scheduling.async_scheduling import StepOverlap
from inference.scheduling.kv_cache import CacheUsage, KVCacheManager, allocate_kv_tensors, describe_plan, plan_cache
from inference.scheduling.scheduler import ScheduledBatch, Scheduler, Sequence, SequenceStatus
from inference.spec_decode.drafter import DraftContext
from inference.spec_decode.drafters import make_drafter

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class SpeculationCounters:
    """Verification steps (a sequence with drafts in a step), drafts verified and drafts kept."""

    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


def _engine_config(options: dict) -> EngineConfig:
    unknown = set(options) - {f.name for f in fields(EngineConfig)}
    if unknown:
        raise TypeError(f"unknown engine options: {', '.join(sorted(unknown))}")
    config = EngineConfig(**options)
    config.validate()
    return config


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if isinstance(dtype, str):
        if dtype not in _DTYPES and dtype != "auto":
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)} or auto")
        return _DTYPES.get(dtype)
    return dtype


class LLMEngine:
    """The synchronous engine core. Not thread-safe: one thread drives it."""

    def __init__(
        self,
        model: GptOssModel,
        config: EngineConfig | None = None,
        model_name: str = "gpt-oss",
        workers: executor.WorkerProcesses | None = None,
    ):
        """`workers`: with tensor parallelism, on rank 0, the other ranks (`executor.py`), handed
        every step the runner runs."""
        config = config or EngineConfig()
        config.validate()
        make_device_current(model.device)
        c = model.config
        self.model = model
        self.config = config
        self.model_name = model_name
        self.vocab_size = c.vocab_size
        self.max_model_len = min(config.max_model_len or c.max_position_embeddings, model.max_positions)
        if self.max_model_len > c.max_position_embeddings:  # (RoPE still runs, past what it was trained on)
            log.warning(
                "max_model_len %d is beyond the %d positions the model's config.json gives "
                "(max_position_embeddings); output quality past them is not known",
                self.max_model_len,
                c.max_position_embeddings,
            )
        self.page_size = config.page_size
        has_sliding = any(c.is_sliding(i) for i in range(c.num_hidden_layers))
        dtype, device = model.dtype, model.device
        kv_dtype = FP8_KV_DTYPE if config.kv_cache_dtype == "fp8" else dtype
        self.drafter = None  # loaded before sizing the cache: its weights and K/V take memory too
        if config.speculative is not None:
            self.drafter = make_drafter(config.speculative, config.draft_model, model)
        self.num_draft_tokens = config.num_draft_tokens if self.drafter is not None else 0

        warmup = getattr(model.attention_backend, "warmup", None)
        if warmup is not None:  # JIT kernels compile now (and count in the memory profile), not mid-request
            lc = model.local_config
            # An EAGLE-3 draft layer keeps its K/V in the model's dtype, beside an fp8 target cache.
            for cache_dtype in dict.fromkeys([kv_dtype, dtype] if self.drafter is not None else [kv_dtype]):
                warmup(
                    lc.num_attention_heads,
                    lc.num_key_value_heads,
                    lc.head_dim,
                    config.page_size,
                    (None, c.sliding_window) if has_sliding else (None,),
                    dtype,
                    cache_dtype,
                )

        memory = None
        if config.num_pages is None:
            memory = self._profile_kv_memory(kv_dtype) if device.type == "cuda" else config.kv_cache_memory
            if model.tp is not None:  # every rank gets the same pages: the tightest rank decides
                memory = model.tp.min_across_ranks(memory)
        plan = plan_cache(
            model.local_config,
            config.page_size,
            kv_dtype,
            memory_bytes=memory,
            num_pages=config.num_pages,
            num_sliding_pages=config.num_sliding_pages,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            extra_full_page_bytes=self.drafter.kv_bytes_per_page(config.page_size) if self.drafter else 0,
        )
        min_sliding = -(-c.sliding_window // config.page_size) + 1
        if has_sliding and plan.num_sliding_pages < min_sliding:
            raise ValueError(
                f"the sliding-layer pool needs at least {min_sliding} pages (window {c.sliding_window}, "
                f"page size {config.page_size}); it has {plan.num_sliding_pages}"
            )
        log.info(describe_plan(plan, c, config.page_size, kv_dtype))
        if plan.num_full_pages * config.page_size < self.max_model_len:
            log.warning(
                "the KV cache holds %d tokens: serving a context of %d tokens instead of %d",
                plan.num_full_pages * config.page_size,
                plan.num_full_pages * config.page_size,
                self.max_model_len,
            )
            self.max_model_len = plan.num_full_pages * config.page_size
        self.kv_caches = allocate_kv_tensors(model.local_config, plan, config.page_size, kv_dtype, device)
        if self.drafter is not None:
            self.drafter.allocate_kv(plan.num_full_pages, config.page_size)
        self.cache = KVCacheManager(
            plan.num_full_pages,
            plan.num_sliding_pages,
            config.page_size,
            c.sliding_window if has_sliding else None,
            plan.bytes_per_full_page,
            plan.bytes_per_sliding_page,
        )
        self.scheduler = Scheduler(
            self.cache, config.max_num_seqs, config.max_num_batched_tokens, config.max_prefill_tokens_decoding
        )
        self.runner = ModelRunner(
            model,
            self.kv_caches,
            config.page_size,
            self.max_model_len,
            config.max_num_seqs,
            has_sliding=has_sliding,
            enforce_eager=config.enforce_eager,
            aux_layers=self.drafter.aux_layers if self.drafter else (),
            num_draft_tokens=self.num_draft_tokens,
            max_prefill_tokens_decoding=config.max_prefill_tokens_decoding,
        )
        self.tokens_prefilled = 0
        self.tokens_decoded = 0
        self.steps = 0
        self.step_clock = StepClock()
        self.spec = SpeculationCounters()
        overlap = config.async_scheduling if config.async_scheduling is not None else device.type == "cuda"
        self.overlap = None  # async scheduling, where it is on
        if config.async_scheduling and (self.drafter is not None or model.tp is not None):
            log.info("async scheduling is off: it does not run with speculative decoding or tensor parallelism")
        if overlap and self.drafter is None and model.tp is None:
            self.overlap = StepOverlap(self.scheduler, self.max_model_len)
        self._inflight: LaunchedStep | None = None  # launched, tokens not read yet (async scheduling)
        self.grammars = GrammarCompiler(c.vocab_size)
        if device.type == "cuda":  # a served model: build the vocabulary's tables now, not for the first grammar
            self.grammars.warm_up()
        self.compiling: dict[str, tuple[Sequence, Future]] = {}  # constrained requests waiting for their grammar
        # Set last: while the engine is built every rank runs the same collectives (memory profile,
        # CUDA graphs) on its own; from here on each step's plan goes to the workers first.
        self.runner.workers = workers

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        attention_backend: str | None = None,
        moe_backend: str | None = None,
        model_name: str | None = None,
        **options,
    ) -> LLMEngine:
        """Load a HF gpt-oss checkpoint and build an engine; `options` are `EngineConfig` fields."""
        config = _engine_config(options)
        dtype = _dtype(dtype)
        make_device_current(device)
        if config.tensor_parallel_size > 1:
            return executor.start_tensor_parallel(
                executor.ModelSource(model_dir=str(model_dir)),
                config,
                cls,
                device=device,
                dtype=dtype,
                attention_backend=attention_backend,
                moe_backend=moe_backend,
                model_name=model_name or Path(model_dir).name,
            )
        model = GptOssModel.from_pretrained(
            model_dir,
            device=device,
            dtype=dtype,
            attention_backend=attention_backend,
            moe_backend=moe_backend,
            max_positions=config.max_model_len,
        )
        return cls(model, config, model_name=model_name or Path(model_dir).name)

    @classmethod
    def from_random(
        cls,
        model_config: ModelConfig,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        attention_backend: str | None = None,
        moe_backend: str | None = None,
        model_name: str = "gpt-oss-random",
        seed: int = 0,
        **options,
    ) -> LLMEngine:
        """An engine on a model of `model_config`'s shapes with random weights made on the device
        (`GptOssModel.from_random`): full-size speed measurements with no checkpoint. `options`
        as in `from_pretrained`; one device only."""
        config = _engine_config(options)
        if config.tensor_parallel_size > 1:
            raise ValueError("random weights run on one device (tensor_parallel_size 1)")
        make_device_current(device)
        model = GptOssModel.from_random(
            model_config,
            device=device,
            dtype=_dtype(dtype),
            attention_backend=attention_backend,
            moe_backend=moe_backend,
            max_positions=config.max_model_len,
            seed=seed,
        )
        return cls(model, config, model_name=model_name)

    def _profile_kv_memory(self, kv_dtype: torch.dtype) -> int:
        """Bytes left for the KV cache on the GPU after the weights and one largest step (over a
        scratch cache of the engine's `kv_dtype`, so that the step also compiles the prefill
        kernels serving will launch)."""
        c = self.model.config
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        scratch = SingleSequenceCache(self.model, tokens, self.config.page_size, kv_dtype=kv_dtype)
        ids = torch.zeros(tokens, dtype=torch.long, device=self.model.device)
        hidden = self.model(ids, scratch.metadata(tokens), scratch.kv_caches)
        # One logits row per sequence, or per verified position with speculation (drafts + 1).
        rows = self.config.max_num_seqs * (self.num_draft_tokens + 1)
        self.model.compute_logits(hidden[-min(tokens, rows) :])
        torch.cuda.synchronize()
        peak, now = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
        del scratch, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        # Sampling works on [rows, vocab] float32 tensors: a few copies (sort, probs, noise) to
        # sample, about ten to verify drafts (draft and target probabilities, residuals, noise).
        copies = 10 if self.num_draft_tokens else 6
        sampler = copies * rows * c.vocab_size * 4
        available = int(total * self.config.gpu_memory_utilization) - (total - free) - (peak - now) - sampler
        if available <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache at gpu_memory_utilization={self.config.gpu_memory_utilization}"
            )
        return available

    # -- requests ------------------------------------------------------------------------------

    def check_request(self, request: GenerationRequest) -> None:
        """Raise ValueError (with a message fit for a 400) if the request cannot be served."""
        check_request(request, self.vocab_size, self.max_model_len)

    def add_request(self, request: GenerationRequest) -> None:
        self.check_request(request)
        if self.scheduler.find(request.request_id) is not None or request.request_id in self.compiling:
            raise ValueError(f"request id {request.request_id!r} is already running")
        sampling = request.sampling
        seq = Sequence(
            request_id=request.request_id,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            sampling=sampling,
            keep_alive=request.keep_alive,
            continue_from=request.continue_from,
        )
        if sampling.seed is not None and not sampling.greedy:
            seq.generator = torch.Generator(device=self.model.device)
            seq.generator.manual_seed(sampling.seed)
        if sampling.grammar is not None:
            self.compiling[seq.request_id] = (seq, self.grammars.submit(sampling.grammar, sampling.stop_token_ids))
            return
        self.scheduler.add(seq)

    def _admit_compiled(self) -> list[TokenDelta]:
        """Hand the requests whose grammar is compiled to the scheduler; end those whose grammar
        failed to compile ("error")."""
        deltas = []
        for request_id, (seq, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[request_id]
            try:
                seq.grammar = future.result()
            except Exception as e:
                deltas.append(self._delta(seq, [], None, "error", error=str(e)))
                continue
            self.scheduler.add(seq)
        return deltas

    def abort(self, request_id: str) -> TokenDelta | None:
        """Stop a request and free its pages now; returns its final delta (None if not live).
        Aborting a parked request's id releases the parked sequence."""
        if request_id in self.compiling:
            seq, _ = self.compiling.pop(request_id)
            return self._delta(seq, [], None, "abort")
        seq = self.scheduler.find(request_id)
        if seq is None:
            self.scheduler.release_parked(request_id)
            return None
        self.scheduler.remove(seq)
        return self._delta(seq, [], None, "abort")

    def release(self, request_id: str) -> bool:
        """Free a parked sequence's pages; False if no such parked sequence."""
        return self.scheduler.release_parked(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None or bool(self.compiling)

    def live_request_ids(self) -> list[str]:
        """Every request not finished yet: running, waiting, or waiting for its grammar."""
        s = self.scheduler
        return [seq.request_id for seq in [*s.running, *s.waiting]] + list(self.compiling)

    @property
    def in_flight(self) -> bool:
        """Whether a launched step's tokens are still to be read (by the next `step()`)."""
        return self._inflight is not None

    @property
    def failure(self) -> str | None:
        """Why this engine can no longer run a step (a tensor-parallel worker exited), or None."""
        workers = self.runner.workers
        return workers.failure if workers is not None else None

    def configure_tensor_parallel(self, all_reduce: str | None = None, decisive_routing: bool | None = None) -> None:
        """For measurements, between steps, on every rank at once: switch how the ranks
        all-reduce (`EngineConfig.tp_all_reduce`; the decode graphs are captured again), or turn
        decisive routing on or off (`GptOssModel.set_decisive_routing`, also on one device)."""
        workers = self.runner.workers
        if workers is not None:
            workers.call("configure_tensor_parallel", dict(all_reduce=all_reduce, decisive_routing=decisive_routing))
        try:
            if decisive_routing is not None:
                self.model.set_decisive_routing(decisive_routing)
            if all_reduce is not None and self.model.tp is not None:
                self.model.tp.set_all_reduce(all_reduce)
                self.runner.recapture_graphs()
        finally:
            if workers is not None:
                workers.expect("called")

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (no step may be running). Idempotent."""
        workers, self.runner.workers = self.runner.workers, None
        if workers is not None:
            workers.close(self.runner)
        self.grammars.close()

    def fail_all(self, error: str) -> list[TokenDelta]:
        """End every running and waiting request with finish_reason "error" (after a bug)."""
        self._inflight = None
        deltas = []
        compiling, self.compiling = [seq for seq, _ in self.compiling.values()], {}
        for seq in compiling:
            deltas.append(self._delta(seq, [], None, "error", error=error))
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            try:
                self.scheduler.remove(seq)
            except Exception:  # bookkeeping already broken: still end the stream
                log.exception("could not free the pages of %s", seq.request_id)
            deltas.append(self._delta(seq, [], None, "error", error=error))
        return deltas

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> list[TokenDelta]:
        """Run one step; its deltas. With async scheduling that step may have been launched by the
        previous call, and the next one may already be running on the device when this returns."""
        admitted = self._admit_compiled() if self.compiling else []
        synchronous = self._inflight is None
        if not synchronous:
            launched, self._inflight = self._inflight, None
        else:
            self.step_clock.planned()
            batch = self.scheduler.schedule()
            if not batch.seqs:
                self.step_clock.idle()
                return admitted
            self.steps += 1
            if self.overlap is None:
                deltas = self._run_synchronously(batch)
                self._step_done(batch, synchronous=True)
                return admitted + deltas
            try:
                launched = self.runner.launch(batch)
            except Exception as e:
                self.step_clock.idle()
                return admitted + self._fail_step(batch, e)
        self._inflight = self._launch_next(launched)  # queued behind `launched` on the device
        try:
            out = self.runner.collect(launched)
        except Exception as e:
            self.step_clock.idle()
            return admitted + self._fail_step(launched.batch, e) + self._sample_inflight()
        deltas = self._apply_step(launched.batch, out)[0]
        self._step_done(launched.batch, synchronous)
        return admitted + deltas + self._sample_inflight()

    def _step_done(self, batch: ScheduledBatch, synchronous: bool) -> None:
        """Charge a step whose tokens were just read and applied its wall time (`StepClock`)."""
        num_tokens = sum(batch.num_new)
        decode_rows = num_tokens - batch.prefill_tokens - sum(batch.num_draft)
        self.step_clock.done(num_tokens, batch.prefill_tokens, synchronous, decode_rows)
        if self._inflight is None and not self.scheduler.has_work():
            self.step_clock.idle()  # nothing left: the next step starts when a request comes

    def _sample_inflight(self) -> list[TokenDelta]:
        """Queue the sampling of the step launched ahead, if it waited for the grammars to take
        the tokens just applied (`ModelRunner.sample_pending`)."""
        step = self._inflight
        if step is None or step.pending is None:
            return []
        try:
            self.runner.sample_pending(step)
        except Exception as e:
            self._inflight = None
            return self._fail_step(step.batch, e)
        return []

    def _launch_next(self, launched: LaunchedStep) -> LaunchedStep | None:
        """Launch the decode step after `launched`, its inputs `launched`'s sampled ids, if the
        overlap allows it now; else the next `step()` schedules synchronously."""
        batch = self.overlap.next_batch(launched.batch)
        if batch is None:
            return None
        try:
            step = self.runner.launch(batch, after=launched)
        except Exception:  # it runs again, synchronously, next step (its pages stay reserved)
            log.exception("could not launch the next step ahead; it runs synchronously")
            return None
        self.steps += 1
        return step

    def _fail_step(self, batch: ScheduledBatch, e: Exception) -> list[TokenDelta]:
        """Fail a step's requests only (those still running); the engine keeps serving, unless
        it cannot (`failure`, then the cause is the requests' error too: a step interrupted by a
        failed tensor-parallel rank says which rank, not what the broken collective said)."""
        log.exception("engine step failed")
        error = self.failure or f"{type(e).__name__}: {e}"
        deltas = []
        for seq in batch.seqs:
            if seq.status == SequenceStatus.RUNNING:
                self.scheduler.remove(seq)
                deltas.append(self._delta(seq, [], None, "error", error=error))
        return deltas

    def _run_synchronously(self, batch: ScheduledBatch) -> list[TokenDelta]:
        try:
            out = self.runner.run(batch)
        except Exception as e:
            return self._fail_step(batch, e)
        starts = [seq.num_computed for seq in batch.seqs]
        deltas, kept = self._apply_step(batch, out)
        if self.drafter is not None:
            try:
                self._propose(batch, out, starts, kept)
            except Exception:  # a failing drafter costs speed, never output: go on without drafts
                log.exception("drafter failed; this step's sequences continue without drafts")
                for seq in batch.seqs:
                    seq.draft_ids.clear()
        return deltas

    def _apply_step(self, batch: ScheduledBatch, out) -> tuple[list[TokenDelta], list[int]]:
        """Apply each entry's tokens; (the deltas, rows each entry keeps in the cache). Entries of
        sequences no longer running (aborted, or stopped while this step was queued behind the
        one that ended them) are dropped."""
        deltas, kept = [], []
        drafts = batch.num_draft or [0] * len(batch)
        for seq, n, d, tokens, logprobs, accepted in zip(
            batch.seqs, batch.num_new, drafts, out.token_ids, out.logprobs, out.num_accepted
        ):
            if seq.status != SequenceStatus.RUNNING:
                kept.append(0)
                continue
            delta, num_kept = self._apply(seq, n, d, tokens, logprobs, accepted)
            kept.append(num_kept)
            if delta is not None:
                deltas.append(delta)
        return deltas, kept

    def _apply(self, seq: Sequence, n: int, num_draft: int, tokens: list[int], logprobs, accepted: int):
        """Append one entry's new tokens (kept drafts, then the target's own), stop at a stop
        condition, roll the KV cache back past the kept tokens. Returns (delta or None, how many
        of the entry's rows stay in the cache)."""
        start = seq.num_computed
        real = n - num_draft  # tokens of token_ids this step ran; the rest were drafts
        if not (real == 1 and start >= seq.num_prompt_tokens and tokens):
            self.tokens_prefilled += real
        if num_draft:
            self.spec.steps += 1
            self.spec.draft_tokens += num_draft
            self.spec.accepted_tokens += accepted
        seq.draft_ids.clear()
        finish = stop_token = None
        emitted = []
        error = None
        for token in tokens:
            seq.token_ids.append(token)
            emitted.append(token)
            if seq.grammar is not None and token not in seq.sampling.stop_token_ids and not seq.grammar.accept(token):
                finish, error = "error", f"token {token} is outside the request's grammar: {seq.grammar.error}"
                break
            finish, stop_token = self._finish_reason(seq, token)
            if finish is not None:
                break
        # Every emitted token but the last was a kept draft whose K/V this step computed.
        seq.num_computed = start + real + max(len(emitted) - 1, 0)
        if self.drafter is not None:  # free pages that held only rejected drafts (or were reserved for them)
            self.cache.truncate(seq.pages, seq.num_computed)
        self.cache.register_computed(seq.pages, seq.token_ids, seq.num_computed)
        if not emitted:
            return None, seq.num_computed - start
        self.tokens_decoded += len(emitted)
        if finish is not None:
            self.cache.truncate(seq.pages, seq.num_computed)  # a page reserved ahead (async scheduling)
            self.scheduler.finish(seq)
        lps = logprobs[: len(emitted)] if logprobs else None
        return self._delta(seq, emitted, lps, finish, stop_token, error=error), seq.num_computed - start

    def _propose(self, batch, out, starts: list[int], kept: list[int]) -> None:
        """Ask the drafter for each still-decoding sequence's next drafts."""
        limits = []
        for seq in batch.seqs:
            limit = 0
            if seq.status == SequenceStatus.RUNNING and seq.num_tokens - seq.num_computed == 1:
                # Room for every kept draft plus the token after them, within both limits.
                limit = min(
                    self.num_draft_tokens,
                    seq.sampling.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens - 1,
                )
                if limit > 0 and self.drafter.writes_ahead:
                    # The drafter writes K/V at the drafted positions: reserve next step's pages now.
                    limit = max(self.cache.fit_tokens(seq.pages, seq.num_computed, 1 + limit) - 1, 0)
                    if limit:
                        self.cache.reserve(seq.pages, seq.num_computed, 1 + limit)
            limits.append(max(limit, 0))
        ctx = DraftContext(list(batch.seqs), starts, kept, out.first_row, limits, out.aux_hidden)
        for seq, proposal, limit in zip(batch.seqs, self.drafter.propose(ctx), limits):
            proposal = list(proposal[:limit])
            if seq.grammar is not None:  # verify only drafts the grammar allows
                proposal = proposal[: seq.grammar.valid_prefix(proposal)]
            seq.draft_ids[:] = proposal

    def _finish_reason(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        if token in seq.sampling.stop_token_ids:
            return "stop", token
        if seq.grammar is not None and seq.grammar.finished:  # the grammar allows nothing more
            return "stop", None
        if seq.num_output_tokens >= seq.sampling.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    @staticmethod
    def _delta(seq: Sequence, tokens, logprobs, finish, stop_token=None, error=None) -> TokenDelta:
        return TokenDelta(
            request_id=seq.request_id,
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason=finish,
            stop_token_id=stop_token,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            error=error,
        )

    # -- numbers -------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            running=len(s.running),
            waiting=len(s.waiting) + len(self.compiling),
            parked=len(s.parked),
            pages_total=self.cache.full.num_pages,
            pages_used=self.cache.full.num_used,
            prefix_queries_tokens=s.counters.prefix_queries_tokens,
            prefix_hit_tokens=s.counters.prefix_hit_tokens,
            tokens_prefilled=self.tokens_prefilled,
            tokens_decoded=self.tokens_decoded,
            preemptions=s.counters.preemptions,
            steps=self.steps,
            spec_steps=self.spec.steps,
            spec_draft_tokens=self.spec.draft_tokens,
            spec_accepted_tokens=self.spec.accepted_tokens,
            step_times=replace(self.step_clock.times),  # a snapshot, not the live counters
        )

    def cache_usage(self) -> CacheUsage:
        """Both pools' page counts, with the sliding window's saving (see `CacheUsage`)."""
        s = self.scheduler
        live = [*s.running, *s.waiting, *s.parked.values()]
        return self.cache.usage([(seq.pages, seq.num_computed) for seq in live])
