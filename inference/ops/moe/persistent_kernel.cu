// The batch-1 MoE block after the router, in one persistent launch (inference/ops/moe/persistent.py).
//
// One CTA per SM. The last warp (CONSUMER_WARPS) is the producer: it streams whole units of
// expert weights into a ring of shared-memory stages with cp.async.bulk, each stage completed by
// an mbarrier's transaction count. A unit is one row group of one (token, slot) pair: for gate_up
// its 8 gate and 8 up rows over all of K (P1 tile pairs, contiguous in the layout of
// inference/ops/moe/triton.py), for down its 8 rows. The other warps are consumer groups of 4
// that take the CTA's units in turn. The CTA's gate_up units come first; then every CTA meets at a grid-wide barrier, since a
// down row needs all of its pair's SwiGLU output; then its down units. The producer never waits
// at that barrier: it streams the down units' weights while gate_up is still being computed, so
// the memory system is not idle across the barrier.
//
// Measured on an H200 it is slower than the Triton GEMVs it replaces, and off by default: see
// docs/benchmark-log.md, "A persistent batch-1 MoE kernel", for where its time goes.
//
// The arithmetic is that of the Triton decode GEMVs: x (and act) are fp16 scaled by a power of
// two and stored in `_permuted` order, each 32-bit weight word becomes four fp16x2 pairs of
// e2m1 * 2^-14, products are summed in fp16 over 4 words, then widened and scaled per 32-value
// block in float32.
//
// Compile-time constants (defined by the Python side): TOP_K, HIDDEN, INTER (H and I), P1, P2
// (tile pairs of a gate_up row and of a down row), STAGES, STAGE_BYTES, CONSUMER_WARPS; for
// benchmarks only, TIMELINE (phase stamps) and LOAD_ONLY (no arithmetic: wrong results).

typedef unsigned int u32;
typedef unsigned long long u64;

struct __align__(16) U4 {
    u32 x, y, z, w;
};

#ifndef CONSUMER_WARPS
#define CONSUMER_WARPS 8
#endif
#define GROUP_WARPS 4
#define GROUPS (CONSUMER_WARPS / GROUP_WARPS)
#define THREADS ((CONSUMER_WARPS + 1) * 32)
#define TILE_WORDS 36  // a 64-value tile of x or act in shared memory: 32 words and 4 of padding
#define MAX_UNITS 64  // 32 gate_up and 32 down units a CTA at most
#define GROUP 8  // rows of a row group
#define G1 (INTER / GROUP)   // gate_up row groups of an expert
#define G2 (HIDDEN / GROUP)  // down row groups of an expert
#define K_PAD (P1 * 128)     // x's padded length
#define I_PAD (P2 * 128)     // act's

__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n .reg .pred done;\n WAIT:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra WAIT;\n}" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// A warp done reading stage s hands it back to the producer (the empty barrier counts one
// arrival a warp of the consuming group).
__device__ __forceinline__ void release_stage(u64* empty, int s, int lane) {
    __syncwarp();
    if (lane == 0) mbar_arrive(shared_address(&empty[s]));
}

__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar, u64 policy) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar), "l"(policy)
        : "memory");
}

__device__ __forceinline__ void consumers_sync() {  // the consumer warps, not the producer
    asm volatile("bar.sync 1, %0;" ::"n"(CONSUMER_WARPS * 32) : "memory");
}

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ float half2_sum(u32 a) {
    float lo, hi;
    asm("{ .reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }" : "=f"(lo), "=f"(hi) : "r"(a));
    return lo + hi;
}

// One weight word's 8 e2m1 values as 4 fp16x2 pairs of e2m1 * 2^-14 (sign to bit 15, magnitude
// to bits 9-11 of each half): the low values of bytes (0, 2) and (1, 3), then the high values.
__device__ __forceinline__ void decode_word(u32 w, u32& h0, u32& h1, u32& h2, u32& h3) {
    const u32 M = 0x8E008E00u;
    h0 = ((w & 0x000F000Fu) * 0x8100u) & M;
    h1 = ((w & 0x0F000F00u) * 0x81u) & M;
    h2 = ((w & 0x00F000F0u) * 0x810u) & M;
    u32 m = w & 0xF000F000u;
    h3 = ((m >> 4) | (m << 3)) & M;
}

// Four consecutive words of one 64-value tile against the activations: xt points at the tile's
// words in shared memory, offset to the quad (low values' x pairs at xt[0..7], high at xt[16..23]).
// Returns the low values' and the high values' sums (two 32-value scale blocks), in units of
// e2m1 * 2^-14 * x.
__device__ __forceinline__ void quad_dot(U4 w, const u32* xt, float& sa, float& sb) {
    const U4 l0 = *reinterpret_cast<const U4*>(xt);
    const U4 l1 = *reinterpret_cast<const U4*>(xt + 4);
    const U4 g0 = *reinterpret_cast<const U4*>(xt + 16);
    const U4 g1 = *reinterpret_cast<const U4*>(xt + 20);
    u32 h0, h1, h2, h3, a, b;
    decode_word(w.x, h0, h1, h2, h3);
    a = hfma2(h1, l0.y, hmul2(h0, l0.x));
    b = hfma2(h3, g0.y, hmul2(h2, g0.x));
    decode_word(w.y, h0, h1, h2, h3);
    a = hfma2(h1, l0.w, hfma2(h0, l0.z, a));
    b = hfma2(h3, g0.w, hfma2(h2, g0.z, b));
    decode_word(w.z, h0, h1, h2, h3);
    a = hfma2(h1, l1.y, hfma2(h0, l1.x, a));
    b = hfma2(h3, g1.y, hfma2(h2, g1.x, b));
    decode_word(w.w, h0, h1, h2, h3);
    a = hfma2(h1, l1.w, hfma2(h0, l1.z, a));
    b = hfma2(h3, g1.w, hfma2(h2, g1.z, b));
    sa = half2_sum(a);
    sb = half2_sum(b);
}

// 2^(scale - 113): with the 2^14 of quad_dot's sums, the block's 2^(scale - 127).
__device__ __forceinline__ float block_factor(u32 scale_byte) { return __uint_as_float((scale_byte + 14u) << 23); }

// acc += one row's quads: `rows` rows a pair in the stage, this thread's row `row` and quad `q`,
// pairs p0, p0 + step, ... < pairs.
__device__ __forceinline__ float row_dot(
    const unsigned char* stage, int rows, int pairs, int row, int q, int p0, int step, const u32* x_tiles) {
    const u32* scales = reinterpret_cast<const u32*>(stage + pairs * rows * 64);
    const int shift = (q >> 1) * 16;
    float acc = 0.0f;
#pragma unroll 4
    for (int p = p0; p < pairs; p += step) {
        const U4 w = *reinterpret_cast<const U4*>(stage + (p * rows + row) * 64 + q * 16);
        const u32 s = scales[p * rows + row] >> shift;
        const u32* xt = x_tiles + (2 * p + (q >> 1)) * TILE_WORDS + 8 * (q & 1);
        float sa, sb;
        quad_dot(w, xt, sa, sb);
        acc = fmaf(sa, block_factor(s & 0xFFu), acc);
        acc = fmaf(sb, block_factor((s >> 8) & 0xFFu), acc);
    }
    return acc;
}

__device__ __forceinline__ int permuted(int k) { return (k & ~3) | ((k & 1) << 1) | ((k >> 1) & 1); }

// x or act rows (fp16, permuted, ROW_LEN values each) -> shared memory tiles of TILE_WORDS words.
// Each thread issues all of its loads before its first store: one memory round trip, not one a
// piece (the loads are volatile asm, kept in order, and a store waits for its load).
template <int ROWS, int ROW_LEN>
__device__ __forceinline__ void load_tiles(u32* dst, const u32* src, int tid) {
    constexpr int QUADS = ROW_LEN / 8;  // 16-byte pieces of a row
    constexpr int PER_THREAD = (ROWS * QUADS + CONSUMER_WARPS * 32 - 1) / (CONSUMER_WARPS * 32);
    U4 v[PER_THREAD];
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
        const int i = tid + j * CONSUMER_WARPS * 32;
        if (i < ROWS * QUADS)
            asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v[j].x), "=r"(v[j].y), "=r"(v[j].z), "=r"(v[j].w)
                         : "l"(src + (i / QUADS) * (ROW_LEN / 2) + (i % QUADS) * 4));
    }
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
        const int i = tid + j * CONSUMER_WARPS * 32;
        const int row = i / QUADS, piece = i % QUADS;
        if (i < ROWS * QUADS) *reinterpret_cast<U4*>(dst + (row * (ROW_LEN / 64) + piece / 8) * TILE_WORDS + (piece % 8) * 4) = v[j];
    }
}

#ifdef TIMELINE  // benchmarks only: %globaltimer stamps of a CTA's phases, after the barrier counter
#define STAMP(i) do { u64 t_; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t_)); \
    barrier[1 + blockIdx.x * 16 + (i)] = t_; } while (0)
#else
#define STAMP(i) do { } while (0)
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 1) moe_decode_persistent(
    const unsigned short* __restrict__ x_half,  // [1, K_PAD] fp16: x * 2^k, permuted (router kernel)
    const float* __restrict__ inv_scale,        // [1]: 2^-k
    const float* __restrict__ logits,           // [1, E] float32
    const unsigned char* __restrict__ w1,       // [E_LOCAL, I/8, P1, 16, 64]
    const unsigned char* __restrict__ s1,       // [E_LOCAL, I/8, P1, 16] int32
    const float* __restrict__ b1,               // [E_LOCAL, 2I]: gates, then ups
    const unsigned char* __restrict__ w2,       // [E_LOCAL, H/8, P2, 8, 64]
    const unsigned char* __restrict__ s2,       // [E_LOCAL, H/8, P2, 8] int32
    const float* __restrict__ b2,               // [E_LOCAL, H]
    unsigned short* __restrict__ act,           // [TOP_K, I_PAD] fp16: act * act_scale, permuted
    float* __restrict__ out,                    // [1, H] float32, zeroed by the router kernel
    const int* __restrict__ valid,              // null, or int32 [1]: 0 means the row is padding
    u64* __restrict__ barrier,                  // [0]: arrivals at the grid barrier, ever (zero at first use);
                                                // then 16 TIMELINE stamps a CTA
    int E, int E0, int E_LOCAL, float limit, float alpha, float act_scale, float inv_act_scale) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) u64 full[STAGES], empty[STAGES];
    __shared__ int units[MAX_UNITS];  // this CTA's units in order: gate_up (>= 0), then down (< 0: ~unit)
    __shared__ int unit_count, gate_up_count, any_pair;
    __shared__ int pair_expert[TOP_K];  // local expert of each slot, -1: not here
    __shared__ float pair_gate[TOP_K];

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    unsigned char* stages = smem;
    u32* tiles = reinterpret_cast<u32*>(smem + STAGES * STAGE_BYTES);  // x, later act
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(shared_address(&full[s]), 1);
            mbar_init(shared_address(&empty[s]), GROUP_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if (tid == 0) STAMP(0);
    __syncthreads();
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the router's outputs are complete
    if (tid == 0) STAMP(1);

    if (warp == CONSUMER_WARPS) {
        // Route: top-k of the logits (ties: lowest id), softmax over the chosen. Each logit becomes
        // an unsigned key in the floats' order (NaN and used ones: 0, below -inf's), so that a
        // round is one redux.sync and a ballot, not a chain of shuffles.
        const bool real = valid == nullptr || *valid > 0;  // (loaded beside the logits)
        u32 key[4];
        float v[4];
        for (int j = 0; j < 4; ++j) {
            const int e = lane + 32 * j;
            v[j] = e < E ? logits[e] : 0.0f;
            const u32 b = __float_as_uint(v[j]);
            key[j] = e >= E || v[j] != v[j] ? 0u : (b & 0x80000000u ? ~b : b | 0x80000000u);
        }
        float denom = 0.0f, first = 0.0f, mine = 0.0f;
        int my_id = 0;  // lane i < TOP_K keeps slot i's pick
        for (int i = 0; i < TOP_K; ++i) {
            const u32 best = __reduce_max_sync(0xffffffffu, max(max(key[0], key[1]), max(key[2], key[3])));
            int idx = E - 1;  // no key left above 0 (NaN logits): still a real expert
            float value = 0.0f;
            bool found = best == 0u;
#pragma unroll
            for (int j = 0; j < 4; ++j) {  // the lowest id holding the best key
                const unsigned holders = __ballot_sync(0xffffffffu, !found && key[j] == best);
                if (holders) {
                    const int owner = __ffs(holders) - 1;
                    idx = owner + 32 * j;
                    value = __shfl_sync(0xffffffffu, v[j], owner);
                    if (lane == owner) key[j] = 0u;
                    found = true;
                }
            }
            if (i == 0) first = value;
            if (lane == i) mine = value, my_id = idx;
            denom += __expf(value - first);
        }
        const int e = my_id - E0;
        const bool here = lane < TOP_K && real && e >= 0 && e < E_LOCAL;
        if (lane < TOP_K) {
            pair_expert[lane] = here ? e : -1;
            pair_gate[lane] = __expf(mine - first) / denom;
        }
        const unsigned pairs_here = __ballot_sync(0xffffffffu, here);
        __syncwarp();
        // This CTA's units, lane n taking the n-th candidate of each kind: gate_up unit
        // u = c + n * grid, down unit d = (grid - 1 - c) + n * grid (the CTAs with one gate_up unit
        // fewer get the extra down units).
        const int u = blockIdx.x + lane * gridDim.x, d = gridDim.x - 1 - blockIdx.x + lane * gridDim.x;
        const bool take_u = u < TOP_K * G1 && pair_expert[u / G1] >= 0;
        const bool take_d = d < TOP_K * G2 && pair_expert[d / G2] >= 0;
        const unsigned mu = __ballot_sync(0xffffffffu, take_u), md = __ballot_sync(0xffffffffu, take_d);
        const unsigned below = (1u << lane) - 1;
        if (take_u) units[__popc(mu & below)] = u;
        if (take_d) units[__popc(mu) + __popc(md & below)] = ~d;
        if (lane == 0) {
            gate_up_count = __popc(mu);
            unit_count = __popc(mu) + __popc(md);
            any_pair = pairs_here != 0;
        }
    } else {
        load_tiles<1, K_PAD>(tiles, reinterpret_cast<const u32*>(x_half), tid);
        if (blockIdx.x == 0)  // act's padding columns: zeros, read by the down rows' zero blocks
            for (int i = tid; i < TOP_K * (I_PAD - INTER); i += CONSUMER_WARPS * 32)
                act[(i / (I_PAD - INTER)) * I_PAD + INTER + i % (I_PAD - INTER)] = 0;
    }
    __syncthreads();

    const int count = unit_count, gate_ups = gate_up_count;
    if (tid == 0) STAMP(2);
    if (warp == CONSUMER_WARPS) {
        if (lane == 0) {
            u64 policy;  // each weight byte is read once a step: first out of L2
            asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
            for (int k = 0; k < count; ++k) {
                const int s = k % STAGES;
                if (k >= STAGES) mbar_wait(shared_address(&empty[s]), ((k / STAGES) - 1) & 1);
                const int unit = units[k];
                const u32 bar = shared_address(&full[s]), dst = shared_address(stages + s * STAGE_BYTES);
                if (unit >= 0) {
                    const size_t chunk = (size_t)pair_expert[unit / G1] * G1 + unit % G1;
                    mbar_expect_tx(bar, P1 * 16 * 68);
                    bulk_load(dst, w1 + chunk * (P1 * 16 * 64), P1 * 16 * 64, bar, policy);
                    bulk_load(dst + P1 * 16 * 64, s1 + chunk * (P1 * 16 * 4), P1 * 16 * 4, bar, policy);
                } else {
                    const int d = ~unit;
                    const size_t chunk = (size_t)pair_expert[d / G2] * G2 + d % G2;
                    mbar_expect_tx(bar, P2 * 8 * 68);
                    bulk_load(dst, w2 + chunk * (P2 * 8 * 64), P2 * 8 * 64, bar, policy);
                    bulk_load(dst + P2 * 8 * 64, s2 + chunk * (P2 * 8 * 4), P2 * 8 * 4, bar, policy);
                }
                if (k == 0) STAMP(3);
                if (k == gate_ups) STAMP(10);
            }
            STAMP(9);
        }
        return;
    }

    // Consumers. Group g (warps 4g..4g+3) takes the CTA's units g, g + GROUPS, ...
    const int group = warp / GROUP_WARPS, gw = warp % GROUP_WARPS;
    const int q = lane & 3, r_lo = (lane >> 2) & 1;
    // gate_up: lane bits q (0-1), row parity (2), gate or up (3), pair offset (4): a quarter warp
    // reads two adjacent rows' 4 quads of one pair, 128 bytes without bank conflicts.
    const float x_inv = *inv_scale;
    int k = group;
    for (; k < gate_ups; k += GROUPS) {
        const int unit = units[k], s = k % STAGES;
        const int slot = unit / G1, g = unit % G1, e = pair_expert[slot];
        const int ud = (lane >> 3) & 1, po = lane >> 4;
        const int row = ud * GROUP + 2 * gw + r_lo, n = g * GROUP + 2 * gw + r_lo;
        const float bias = b1[(size_t)e * 2 * INTER + ud * INTER + n];  // used after the loop: its latency hides
        mbar_wait(shared_address(&full[s]), (k / STAGES) & 1);
        if (tid == 0 && k == 0) STAMP(4);
#ifdef LOAD_ONLY
        float acc = 0.0f;
#else
        float acc = row_dot(stages + s * STAGE_BYTES, 2 * GROUP, P1, row, q, po, 2, tiles);
#endif
        release_stage(empty, s, lane);
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        acc += __shfl_xor_sync(0xffffffffu, acc, 16);
        acc = acc * x_inv + bias;
        const float up = __shfl_xor_sync(0xffffffffu, acc, 8);
        if ((lane & 0x1b) == 0) {  // lanes 0 and 4: gate rows 2gw and 2gw + 1 of this group
            const float gate = fminf(acc, limit);
            const float u = fminf(fmaxf(up, -limit), limit);
            const float y = (u + 1.0f) * gate / (1.0f + __expf(-alpha * gate)) * act_scale;
            unsigned short h;
            asm("{ .reg .f16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(y));
            act[slot * I_PAD + permuted(n)] = h;
        }
    }

    if (!any_pair) return;  // no pair is routed here (a padding row, or all experts elsewhere)
    // Every pair's act is complete once every CTA has passed here.
    if (tid == 0) STAMP(5);
    consumers_sync();
    if (tid == 0) STAMP(6);
    if (tid == 0) {
        // A counter that only grows (64 bits never wrap): this launch's CTAs take arrivals
        // [n * grid, (n + 1) * grid), so all have arrived once it reaches the end of that range.
        // The release add publishes the CTA's act stores (ordered before it by consumers_sync).
        u64 old;
        asm volatile("atom.add.release.gpu.global.u64 %0, [%1], 1;" : "=l"(old) : "l"(barrier) : "memory");
        const u64 target = old - old % gridDim.x + gridDim.x;
        u64 now;
        do {
            asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(now) : "l"(barrier) : "memory");
        } while (now < target);
    }
    consumers_sync();
    if (tid == 0) STAMP(7);
    load_tiles<TOP_K, I_PAD>(tiles, reinterpret_cast<const u32*>(act), tid);
    consumers_sync();
    if (tid == 0) STAMP(8);

    // down: lane bits q (0-1), row parity (2), pair offset (3-4); warp gw has rows 2gw, 2gw + 1.
    // k is already this group's first unit past the gate_up ones (unit k is group k % GROUPS's).
    for (; k < count; k += GROUPS) {
        const int d = ~units[k], s = k % STAGES;
        const int slot = d / G2, g = d % G2, e = pair_expert[slot];
        const int po = lane >> 3;
        const int row = 2 * gw + r_lo, n = g * GROUP + row;
        const float bias = b2[(size_t)e * HIDDEN + n];
        mbar_wait(shared_address(&full[s]), (k / STAGES) & 1);
#ifdef LOAD_ONLY
        float acc = 0.0f;
#else
        float acc = row_dot(stages + s * STAGE_BYTES, GROUP, P2, row, q, po, 4, tiles + slot * (I_PAD / 64) * TILE_WORDS);
#endif
        release_stage(empty, s, lane);
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        acc += __shfl_xor_sync(0xffffffffu, acc, 8);
        acc += __shfl_xor_sync(0xffffffffu, acc, 16);
        if ((lane & 0x1b) == 0) atomicAdd(out + n, pair_gate[slot] * (acc * inv_act_scale + bias));
    }
    if (lane == 0 && gw == 0 && group < 4) STAMP(11 + group);
}
