// evotune: the Hopper (sm_90a) variant of the fused attention forward (knob mma = wgmma).
//
// Same math and masking as attention_fwd (kernels/attention.cu); different machinery:
//   - Q, K and V tiles arrive by TMA (cp.async.bulk.tensor with a tensor map per tensor,
//     128-byte swizzle), each load completing on an mbarrier (transaction bytes);
//   - S = Q K^T and O += P V run on wgmma.mma_async (m64nNk16, fp32 accumulators): each
//     consumer warpgroup owns 64 query rows; K is read K-major and V N-major (transposed)
//     straight from the swizzled tiles through matrix descriptors; P goes from the S
//     accumulators to registers as the A operand of P V (never through shared memory);
//     Q is read from shared memory by each Q K^T (Q_IN_REGS = false) or loaded once into
//     registers with ldmatrix (true);
//   - PRODUCER_WARPS = 4: a producer warpgroup streams K/V through STAGES slots (full and
//     empty mbarriers per slot) and, with two consumer warpgroups, gives registers to them
//     with setmaxnreg; PRODUCER_WARPS = 0: one consumer thread issues the TMA loads;
//   - PINGPONG (two consumer warpgroups): named barriers take turns between the
//     warpgroups issuing their matrix products, so one warpgroup's softmax runs under the
//     other's wgmma (FlashAttention-3's inter-warpgroup schedule);
//   - PERSISTENT (with a producer warpgroup): a grid of at most one CTA per SM walks the query
//     tiles (persistent_tile's order); the producer loads the next tile's Q and first K/V tiles
//     while the consumers finish the current one (its last P V and the epilogue), the K/V slots'
//     phases counting on across tiles. Non-causal tiles are all alike, so CTA b takes tiles b,
//     b + gridDim.x, ...; causal ones differ up to seq_k / BLOCK_N-fold, and that fixed share
//     ran 10% slower than one tile per CTA on the H100 (llama-4k and long-16k causal), so each
//     CTA's producer takes its next tile from a global counter (FlashAttention-3's dynamic
//     scheduler for causal) and hands it to its consumers with the Q load. Otherwise each CTA
//     computes the one tile of its blockIdx.
//
// Tile layout in shared memory (what TMA writes with SWIZZLE_128B and wgmma reads with
// the 128-byte swizzle mode): a tile of R rows x HEAD_DIM columns is HEAD_DIM/64 regions,
// each R rows of 128 bytes (64 columns); 16-byte chunk c of row r sits at chunk c ^ (r & 7).
// Every tile starts on a 1024-byte boundary (the swizzle atom: 8 rows x 128 bytes).

#include "wgmma.cuh"
#include "wgmma_wide.cuh"

namespace hopper {

// PickType<B, A, C>::type: A when B, else C (std::conditional, without the standard headers NVRTC lacks).
template <bool B, class A, class C> struct PickType { using type = A; };
template <class A, class C> struct PickType<false, A, C> { using type = C; };

template <int BLOCK_N_, int CONSUMER_WGS_, int PRODUCER_WARPS_, int STAGES_, bool Q_IN_REGS_, bool PINGPONG_,
          bool PERSISTENT_, bool PDL_, bool TMA_STORE_, int EXP2_FMA_, int RESCALE_SLACK_, bool SOFTMAX_OVERLAP_,
          bool LEAN_ADDRESSING_, bool CAUSAL_WG_, bool SKIP_EMPTY_, bool P_SMEM_, bool STRIPE_MIRROR_, int HEAD_DIM_, bool IS_BF16_, bool IS_CAUSAL_,
          bool SOFTCAP_ = false, bool LOCAL_ = false, bool SINKS_ = false, bool VARLEN_ = false, int HEAD_DIM_V_ = 0>
struct HopperTraits {
    static constexpr int kBlockN = BLOCK_N_;
    static constexpr int kConsumerWGs = CONSUMER_WGS_;
    static constexpr int kProducerWarps = PRODUCER_WARPS_;
    static constexpr int kStages = STAGES_;
    static constexpr bool kQInRegs = Q_IN_REGS_;
    static constexpr bool kPingPong = PINGPONG_;
    static constexpr bool kPersistent = PERSISTENT_;
    static constexpr bool kPdl = PDL_;  // pdl: griddepcontrol.wait before the first global access (docs/PDL.md)
    static constexpr bool kTmaStore = TMA_STORE_;  // epilogue = tma: O staged in shared memory, stored by TMA
    static constexpr int kExp2FmaEighths = EXP2_FMA_;  // exp2_fma: eighths of each row's exp2 on the FMA pipe
    // rescale: a new max's slack, log2 (new_max 0, lazy 8); -1 = always (every tile's max taken, O always rescaled)
    static constexpr int kRescaleSlackLog2 = RESCALE_SLACK_;
    static constexpr bool kLazyRescale = kRescaleSlackLog2 >= 0;
    static constexpr bool kSoftmaxOverlap = SOFTMAX_OVERLAP_;  // softmax_overlap: the consumer loop rotated
    // lean_addressing: descriptors advanced by one add (smem_desc16), the K/V slots' sequence counted unsigned
    static constexpr bool kLeanAddressing = LEAN_ADDRESSING_;
    using SlotUse = typename PickType<kLeanAddressing, unsigned, int>::type;  // a K/V tile's place in the slots' sequence
    // causal_extent = warpgroup: each consumer warpgroup stops at its own diagonal (warpgroup_kv_tiles)
    static constexpr bool kCausalWarpgroup = CAUSAL_WG_;
    // empty_warpgroups = skip: a consumer warpgroup whose rows all lie past seq_q walks the barriers only (drain_tile)
    static constexpr bool kSkipEmpty = SKIP_EMPTY_;
    // p_operand = smem: P V's P from the warpgroup's P tile in shared memory (store_p, issue_pv_smem; kPBytes)
    static constexpr bool kPSmem = P_SMEM_;
    // stripe_order = mirrored: consumer warpgroup wg computes stripe wg of the CTA's even query tiles and W - 1 - wg of
    // its odd ones, with Q in two buffers (mirrored_stripe, q_buffer; the second at kQ1Offset, which the instantiation
    // adds)
    static constexpr bool kStripeMirror = STRIPE_MIRROR_;
    static constexpr int kHeadDim = HEAD_DIM_;
    static constexpr bool kIsBf16 = IS_BF16_;
    static constexpr bool kIsCausal = IS_CAUSAL_;
    // The shape's score modifiers (not searched knobs: the problem's semantics, as IS_CAUSAL). kSoftcap: each score s
    // becomes C tanh(s scale / C), the cap C a runtime argument (ScoreArgs); kLocal: a sliding window (ScoreArgs'
    // window_left / right), whose query tiles walk only the K/V tiles some row of theirs sees (kv_tile_range).
    static constexpr bool kSoftcap = SOFTCAP_;
    static constexpr bool kLocal = LOCAL_;
    // kSinks: attention sinks (gpt-oss's s_aux): each query head's sink logit (ScoreArgs' sinks, in the units of the
    // scaled scores) joins every row's softmax denominator in the epilogue (row_total); the main loop is untouched.
    static constexpr bool kSinks = SINKS_;
    // kVarlen: variable-length packed batches (flash-attention's cu_seqlens; hopper/varlen.cuh): the grid's batch axis
    // is the sequence, each CTA's seq_q / seq_k its sequence's lengths, its TMA rows packed rows (packed_row).
    static constexpr bool kVarlen = VARLEN_;
    // A row may see no key: a window's (kLocal), or a varlen sequence's with queries and no keys. Such a row keeps
    // shift 0 and alpha 1 rather than NaN, and the epilogue writes it 0.
    static constexpr bool kEmptyRows = kLocal || kVarlen;
    // V's head dim where it differs from Q's and K's (DeepSeek-V2/V3 MLA prefill: 192 for Q K^T, 128 for V and O;
    // flash-attention's hdim_v); 0: the same. Not a searched knob: the problem's shape, as HEAD_DIM.
    static constexpr int kHeadDimV = HEAD_DIM_V_ == 0 ? HEAD_DIM_ : HEAD_DIM_V_;

    static constexpr int kBlockM = 64 * kConsumerWGs;  // wgmma's M is 64 per warpgroup
    static constexpr int kConsumerThreads = 128 * kConsumerWGs;
    static constexpr bool kHasProducer = kProducerWarps > 0;
    static constexpr int kThreads = kConsumerThreads + 32 * kProducerWarps;
    // The tiles hold whole 128-byte regions of 64 columns: a head dim that is not a multiple of 64 (96) is held as the
    // next one (128), its columns past kHeadDim filled with zeros by TMA (the tensor maps' extent is the head dim), so
    // the swizzle and the descriptors stay those of whole regions (CUTLASS would switch to a 64-byte swizzle atom).
    // Q K^T reads only the real columns' k-steps; P V's N is the tile's (a multiple of 64), and the epilogue stores
    // the real columns only.
    static constexpr int kTileDim = (kHeadDim + 63) / 64 * 64;
    static constexpr int kRegions = kTileDim / 64;  // 128-byte column regions of a tile
    // V's and O's tiles, by the same rule (kHeadDimV): P V's wgmma N, O's accumulators, the epilogue's regions.
    static constexpr int kTileDimV = (kHeadDimV + 63) / 64 * 64;
    static constexpr int kRegionsV = kTileDimV / 64;
    static constexpr int kQKSteps = kHeadDim / 16;
    static constexpr int kQRegSteps = kQInRegs ? kQKSteps : 1;  // Q k-steps held in registers
    static constexpr int kPVSteps = kBlockN / 16;
    static constexpr int kSAcc = kBlockN / 2;    // S accumulators per thread (64 rows x BLOCK_N / 128)
    static constexpr int kOAcc = kTileDimV / 2;  // O accumulators per thread
    static constexpr int kQBytes = kBlockM * kTileDim * 2;
    // A K slot and a V slot (equal but where kHeadDimV differs); the K slots first, then the V slots.
    static constexpr int kKBytes = kBlockN * kTileDim * 2;
    static constexpr int kVBytes = kBlockN * kTileDimV * 2;
    static constexpr int kOBytes = kBlockM * kTileDimV * 2;  // a CTA's O tile (the TMA-store epilogue's staging)
    // Tiles plus the slack to align the dynamic shared memory to the 1024-byte swizzle atom.
    static constexpr int kSmemBytes = kQBytes + kStages * (kKBytes + kVBytes) + 1024;
    // setmaxnreg: with a producer warpgroup the consumers take the producer's registers.
    // Two consumer warpgroups (384 threads, launch bound 168 registers each): producer 24,
    // consumers 240, 128*24 + 256*240 = 64512 of the 65536. Three (512 threads, launch bound
    // 128): producer 32, consumers 160, 128*32 + 384*160 = 65536 (FlashAttention-3's split for
    // its 192-row d64 tiles). One consumer warpgroup already has 255.
    static constexpr bool kSetMaxNReg = kHasProducer && kConsumerWGs >= 2;
    // Four consumer warpgroups (block_m 256: 640 threads, launch bound 96 registers each: 65536 / 640 rounded down to
    // the allocation's 8): producer 24, consumers 112, 128*24 + 512*112 = 60416 of the CTA's 61440. setmaxnreg.inc
    // takes what the CTA's setmaxnreg.dec freed, never the SM's unallocated rest: a split above the launch's
    // allocation (consumers 120: 64512) waits forever (it hung the H100).
    // stripe_order = mirrored at four consumer warpgroups: producer 32. Its two Q buffers' barriers and four handed-tile
    // entries took the 24-register producer over (ptxas spilled 8 bytes, the persistent order's section width, which
    // the consumers then reloaded from local memory at every tile); 128*32 + 512*112 = 61440 is the launch's whole
    // allocation, which setmaxnreg.inc may take.
    static constexpr int kProducerRegs = kConsumerWGs == 3 || (kStripeMirror && kConsumerWGs == 4) ? 32 : 24;
    static constexpr int kConsumerRegs = kConsumerWGs == 4 ? 112 : kConsumerWGs == 3 ? 160 : 240;

    static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256,
                  "head dim 64, 96, 128, 192 or 256 (P V's wgmma N: 64, 128, 192, 256)");
    // A value head dim of its own: the pairs the space admits (DeepSeek MLA's 192/128, and 128/64). O is no wider
    // than Q, so the one-tile TMA-store epilogue can stage O in Q's buffer as it does at equal head dims.
    static_assert(kHeadDimV == kHeadDim || (kHeadDim == 192 && kHeadDimV == 128) || (kHeadDim == 128 && kHeadDimV == 64),
                  "value head dim: that of Q and K, or 128 beside 192 (DeepSeek MLA), or 64 beside 128");
    static_assert(kPSmem || kBlockN == 16 || kBlockN == 32 || kBlockN == 64 || kBlockN == 128 || kBlockN == 176,
                  "BLOCK_N: a wgmma N of 16 to 128, or 176 (FlashAttention-3's d128 tile)");
    static_assert(!kPSmem || kBlockN == 64 || kBlockN == 128 || kBlockN == 192,
                  "p_operand = smem: P in whole 64-key regions of the 128-byte swizzle, up to FlashAttention-3's 192-key "
                  "d64 tile");
    static_assert(kRescaleSlackLog2 >= -1 && kRescaleSlackLog2 <= 8,
                  "rescale: -1 (always), or a slack of 0 (new_max) to 8 (lazy: P at most 256, inside fp16's range)");
    static_assert(kConsumerWGs >= 1 && kConsumerWGs <= 4, "one to four consumer warpgroups (64 to 256 query rows)");
    static_assert(kProducerWarps == 0 || kProducerWarps == 4, "the producer is a whole warpgroup (setmaxnreg is per warpgroup)");
    static_assert(!kPingPong || kConsumerWGs == 2, "ping-pong needs two consumer warpgroups");
    static_assert(!kCausalWarpgroup || kIsCausal,
                  "causal_extent = warpgroup: only a causal tile has K/V tiles past a warpgroup's rows");
    static_assert(!kCausalWarpgroup || !kPingPong, "causal_extent = warpgroup: ping-pong's turns assume equal loops");
    // Persistent: the producer warpgroup alone loads, so it can run a tile ahead; ping-pong's per-tile turn
    // protocol (warpgroup 1 owes no turn after its last K/V tile) is not carried across tiles.
    static_assert(!kPersistent || (kHasProducer && !kPingPong), "a persistent CTA needs a producer and no ping-pong");
    // stripe_order = mirrored evens out the warpgroups' unequal K/V ranges over a persistent CTA's consecutive tiles:
    // only causal_extent = warpgroup makes them unequal, and only a persistent CTA has a next tile.
    static_assert(!kStripeMirror || (kPersistent && kCausalWarpgroup),
                  "stripe_order = mirrored: a persistent CTA with causal_extent = warpgroup");
    static_assert(!kSkipEmpty || !kPingPong, "empty_warpgroups = skip: an empty warpgroup does not take ping-pong's turns");
    static_assert(!kSkipEmpty || !kCausalWarpgroup || kHasProducer,
                  "causal_extent = warpgroup with skip: an empty last warpgroup would not refill");
    // A window's tiles start past key 0 (KvRange::first); causal_extent = warpgroup's per-warpgroup diagonal (and so
    // stripe_order = mirrored) counts its tiles from key 0.
    static_assert(!kLocal || !kCausalWarpgroup, "a sliding window with causal_extent = tile");
    // VARLEN: the TMA-store epilogue's boxes would write past a sequence's last row into the next sequence's O (the
    // register epilogue checks each row); the persistent order walks (head, batch) tiles, not sequences.
    static_assert(!kVarlen || (!kTmaStore && !kPersistent), "VARLEN: the register epilogue on the one-tile grid");
    static_assert(kStages >= 1 && kStages <= 8, "1 to 8 pipeline stages (5 to 8: the deep ring's barriers)");
    // The K/V ring's barriers (Barriers): four slots, or eight for the deep ring (stages 5 to 8).
    static constexpr int kBarrierSlots = kStages > 4 ? 8 : 4;
    static_assert(kHasProducer || kStages >= 2,
                  "without a producer the loader refills a slot mid-tile: one stage would wait on itself");
    static_assert(kKBytes % 1024 == 0 && kVBytes % 1024 == 0, "K/V tiles must keep the 1024-byte swizzle alignment");
    // The per-CTA shared memory and thread limits: asserted by the instantiation (evotune/limits.py).
};

// ---- window geometry (plain C++: tests/test_softcap_window.py compiles this stretch with the host compiler)
// A sliding window (kLocal): query row r sees keys r + diag - left .. r + diag + right, diag = seq_k - seq_q (bottom-right
// aligned, flash-attention's window_size). left and right come clamped to [0, seq_k] and [0, seq_q] (ScoreArgs).
struct KvWindow {
    int diag, left, right;
};

// The K/V tiles a query tile walks: key tiles first .. first + count - 1.
struct KvRange {
    int first, count;
};

// Whether K/V tile kv0 lies whole inside the window of each of the 64 rows from row0 (a warpgroup's): its first key at
// or past the last row's left edge and its last key at or before the first row's right edge. Where not, the tile is
// masked element by element (mask_scores).
template <class T>
__device__ __forceinline__ bool window_holds_tile(int kv0, int row0, const KvWindow& win) {
    return kv0 >= row0 + 63 + win.diag - win.left && kv0 + T::kBlockN - 1 <= row0 + win.diag + win.right;
}
// ---- end of the window geometry

// The kernel's pieces (kernels/hopper/, the PTX wrappers in ptx.cuh): the consumer warpgroups' tile algebra, the
// K/V ring, the tile scheduler, the producer and the epilogue. attention_fwd_wgmma below composes them: the loader (the producer
// warpgroup's first thread, or a consumer's) fills the ring in the scheduler's order, consume_tile runs a query
// tile's consumer loop over it and hands O to the epilogue.
#include "hopper/varlen.cuh"
#include "hopper/consumer.cuh"
#include "hopper/ring.cuh"
#include "hopper/scheduler.cuh"
#include "hopper/producer.cuh"
#include "hopper/epilogue.cuh"

// q_map, k_map, v_map: the CUtensorMaps of Q, K and V, each over the 4-D view (head_dim, seq, head,
// batch) with boxes of 64 columns x BLOCK_M (Q) or BLOCK_N (K, V) rows. They point at the entry
// point's __grid_constant__ parameters (kernel parameter space, as FlashAttention-3 and CUTLASS pass
// them): a launch carries them by value, so nothing is uploaded per call and a CUDA graph records them.
// K's and V's maps describe heads / group heads (grouped-query attention): query head h loads K/V
// head h / group (kv_head_of; kv_magic is 0 without grouping).
//
// Consumer loop, per warpgroup (FlashAttention-3's intra-warpgroup pipelining): iteration t
// issues S(t) = Q K(t)^T and then O += P(t-1) V(t-1), waits for S(t) only, runs the softmax
// of tile t while P V runs on the tensor cores, then waits for P V, rescales O and packs
// P(t). K(t)'s slot is released as soon as S(t) is done, V(t-1)'s after P V.
// WRITE_LSE (training, not a knob): also write each row's log-sum-exp to lse[batch * lse_sb + head *
// lse_sh + row] (see attention_fwd). n_heads, n_batch: the query heads and batch (read by PERSISTENT only;
// the one-tile grid has them as gridDim.y and z). tile_counter: PERSISTENT causal only (else unread), two
// unsigned counters that are zero when the launch starts (the tiles handed out past the first gridDim.x, and
// the CTAs done); the last CTA to finish zeroes them again, so one zeroed pair serves launch after launch on
// one stream (two launches running at once need a pair each).
// The score modifiers' runtime values (read only where the traits have kSoftcap / kLocal / kSinks). softcap_scale: scale / C
// (the scores go through tanh(s * softcap_scale), and scale_log2 is then C log2(e): FlashAttention-3's folding, one
// multiply before the tanh and the usual FMA after). window_left / right: the window, clamped by the host to
// [0, seq_k] and [0, seq_q] (unbounded sides too), so every row bound below stays inside int. sinks: n_heads fp32 sink
// logits, one per query head.
struct ScoreArgs {
    float softcap_scale;
    int window_left, window_right;
    const float* __restrict__ sinks;
};

template <class T, bool WRITE_LSE = false>
__device__ __forceinline__ void attention_fwd_wgmma(const CUtensorMap* q_map, const CUtensorMap* k_map,
                                                    const CUtensorMap* v_map, unsigned short* __restrict__ o,
                                                    long long o_sb, long long o_sh, long long o_ss, int seq_q, int seq_k,
                                                    float scale_log2, unsigned kv_magic, int n_heads, int n_batch,
                                                    unsigned* __restrict__ tile_counter,
                                                    const CUtensorMap* o_map,  // epilogue = tma only (else null)
                                                    float* __restrict__ lse = nullptr, long long lse_sb = 0,
                                                    long long lse_sh = 0, ScoreArgs score_args = {0.f, 0, 0, nullptr},
                                                    VarlenArgs varlen = {nullptr, nullptr}) {
    // Aligned by hand (kSmemBytes has the slack): __align__(1024) here would pad the static
    // shared memory to 1024 bytes as well.
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ Barriers<T> bars;
    const u32 smem_base = (smem_addr(smem_raw) + 1023) & ~1023u;
    const u32 sQ = smem_base;
    const u32 sK = sQ + T::kQBytes;
    const u32 sV = sK + T::kStages * T::kKBytes;

    const int tid = threadIdx.x;
    // Where each consumer warpgroup's output goes (hopper/epilogue.cuh).
    // (Not const: VARLEN moves them to the CTA's sequence once it has read it, below.)
    Epilogue<T, WRITE_LSE> epilogue{o, o_sb, o_sh, o_ss, o_map, lse, lse_sb, lse_sh, seq_q, scale_log2,
                                    score_args.sinks};
    // Without PERSISTENT, the CTA's one query tile.
    QTile one_tile = grid_tile<T>();
    const int grid_kv_head = kv_head_of(one_tile.head, kv_magic);  // the K/V maps' head coordinate
    KvWindow window{seq_k - seq_q, score_args.window_left, score_args.window_right};
    KvRange grid_range = kv_tile_range<T>(one_tile.row0, seq_k, window);
    // The thread that issues TMA: the producer warpgroup's first, or the first consumer's.
    // causal_extent = warpgroup, without a producer: the last consumer warpgroup's first thread, since that warpgroup
    // alone walks every K/V tile of the CTA (the others stop at their own diagonals) and so refills every slot.
    const int loader = T::kHasProducer ? T::kConsumerThreads : T::kCausalWarpgroup ? T::kConsumerThreads - 128 : 0;

    if (tid == loader) {
        mbar_init(smem_addr(&bars.q_full), 1);
        if constexpr (T::kPersistent) mbar_init(smem_addr(&bars.q_empty), T::kConsumerThreads / 32);
        if constexpr (T::kStripeMirror) {
            for (int b = 0; b < 2; ++b) {
                mbar_init(smem_addr(&bars.q_buf_full[b]), 1);
                mbar_init(smem_addr(&bars.q_buf_empty[b]), T::kConsumerThreads / 32);
            }
        }
#pragma unroll
        for (int s = 0; s < T::kStages; ++s) {
            mbar_init(smem_addr(&bars.k_full[s]), 1);
            mbar_init(smem_addr(&bars.v_full[s]), 1);
            mbar_init(smem_addr(&bars.k_empty[s]), T::kConsumerThreads / 32);  // one arrival per consumer warp
            mbar_init(smem_addr(&bars.v_empty[s]), T::kConsumerThreads / 32);
        }
        mbar_init_fence();
        tma_prefetch_map(q_map);
        tma_prefetch_map(k_map);
        tma_prefetch_map(v_map);
        if constexpr (T::kTmaStore) tma_prefetch_map(o_map);
    }
    __syncthreads();
    // Above: shared-memory carve-up, index arithmetic, mbarrier init and the prefetch of the tensor maps (kernel
    // parameters, not memory another grid writes). Every global access of this CTA follows, in every thread:
    // the TMA loads of Q, K and V, the stores of O (and the log-sum-exp), the persistent causal grid's tile
    // counters. So each one sees the previous grid's writes complete and cannot overwrite what that grid
    // still reads. Then the next PDL-launched grid may begin launching while this one runs.
    if constexpr (T::kPdl) {
        pdl_wait();
        pdl_launch_dependents();
    }
    // VARLEN (hopper/varlen.cuh): the CTA's sequence. From here on the CTA is a dense one on a batch of one with the
    // sequence's lengths: O's rows (and the log-sum-exp's, laid out (heads, total_q)) start at the sequence's first
    // packed row, the TMA boxes at its packed rows (seq_rows), the window and the K/V range are the sequence's. A
    // sequence with no keys walks one tile, masked whole (its rows come out 0).
    SeqRows seq_rows{0, 0};
    if constexpr (T::kVarlen) {
        if (!varlen_sequence<T>(varlen, one_tile.row0, seq_rows, seq_q, seq_k)) return;  // past the sequence's queries
        epilogue.o += seq_rows.q * o_ss;
        epilogue.seq_q = seq_q;
        if constexpr (WRITE_LSE) epilogue.lse += seq_rows.q;
        one_tile.batch = 0;
        window = KvWindow{seq_k - seq_q, score_args.window_left, score_args.window_right};
        grid_range = kv_tile_range<T>(one_tile.row0, seq_k, window);
        grid_range.count = max(grid_range.count, 1);
    }

    // One query tile of the consumer warpgroups: `it0` K/V tiles went through the slots before it (the
    // slot of its K/V tile t is (it0 + t) % STAGES), and its Q arrives in phase `q_phase` of q_full. stripe_order =
    // mirrored: q_phase is qi, the CTA's query tiles before this one, which picks Q's buffer, its phase and the stripes.
    // kv_first: the query tile's first K/V tile (KvRange::first: 0 but with a window); K/V tile t of the walk is key
    // tile kv_first + t.
    auto consume_tile = [&](const QTile& w, int kv_head, int cta_tiles, int kv_first, int it0, int q_phase) {
        // The CTA's K/V tiles, then (causal_extent = warpgroup, below the empty test) this warpgroup's.
        int n_tiles = cta_tiles;
        const int wg = tid / 128;
        const int warp_in_wg = (tid % 128) / 32;
        const int lane = tid & 31;
        const int qi = q_phase;  // stripe_order = mirrored: the CTA's query tiles before this one
        // The tile's 64-row stripe this warpgroup computes: its own, or with stripe_order = mirrored mirrored_stripe's.
        int stripe = wg;
        if constexpr (T::kStripeMirror) stripe = mirrored_stripe<T>(wg, qi);
        u32 sQ_wg;  // this warpgroup's 64 rows inside each region
        if constexpr (T::kStripeMirror) sQ_wg = q_buffer<T>(smem_base, qi) + stripe * (64 * 128);
        else sQ_wg = sQ + wg * (64 * 128);
        u32 sP_wg = 0;  // p_operand = smem: its P tile
        if constexpr (T::kPSmem) sP_wg = smem_base + T::kSmemBytes - 1024 - T::kPBytes + wg * (64 * T::kBlockN * 2);
        // Every use of the tile's first row below is q_row0 + 64 * wg, the first row of the warpgroup's rows (wg stays
        // the physical warpgroup: it indexes the staging rows, the P tile and the named barriers). Shifted by the
        // stripe's offset (mirrored), that sum is the first row of the stripe this warpgroup computes.
        int q_row0 = w.row0;
        if constexpr (T::kStripeMirror) q_row0 = w.row0 + 64 * (stripe - wg);
        const int head = w.head, batch = w.batch;
        const int q_row = q_row0 + 64 * wg + 16 * warp_in_wg + (lane >> 2);  // the first of the thread's two rows
        if constexpr (T::kSkipEmpty) {
            if (q_row0 + 64 * wg >= seq_q) {  // every row of this warpgroup is padding (uniform per warpgroup)
                drain_tile<T>(&bars, n_tiles, it0, q_phase, lane);
                return;
            }
        }
        if constexpr (T::kCausalWarpgroup) n_tiles = warpgroup_kv_tiles<T>(q_row0 + 64 * wg, seq_k);  // to its diagonal

        float o_acc[T::kOAcc];
        float s_acc[T::kSAcc];
        u32 p[T::kPVSteps][4];
        u32 qr[T::kQRegSteps][4];
        float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};
        // kSinks: the head's sink logit, loaded before the main loop so its latency hides under it (read at the
        // epilogue, it stalled the one-tile mission shape by 1% of its time); 0 and no load without sinks.
        const float sink_log2 = epilogue.sink_log2_of(head);
#pragma unroll
        for (int i = 0; i < T::kOAcc; ++i) o_acc[i] = 0.f;
#pragma unroll
        for (int i = 0; i < T::kSAcc; ++i) s_acc[i] = 0.f;

        if constexpr (T::kStripeMirror) mbar_wait(smem_addr(&bars.q_buf_full[qi & 1]), (qi >> 1) & 1);
        else mbar_wait(smem_addr(&bars.q_full), q_phase);
        // The previous tile's epilogue branched per lane (rows past seq_q): reconverge before the .aligned
        // instructions (ldmatrix's users, wgmma) rather than rely on ptxas to.
        if constexpr (T::kPersistent) __syncwarp();
        if constexpr (T::kQInRegs) {
            load_q_regs<T>(qr, sQ_wg, warp_in_wg, lane);
            if constexpr (T::kPersistent) {
                // Q is in registers: the producer may load the next tile's over it. The generic-proxy reads
                // (ldmatrix) are ordered before the TMA's async-proxy writes by the fence.
                fence_proxy_async_smem();
                __syncwarp();
                if constexpr (T::kStripeMirror) {
                    if (lane == 0) mbar_arrive(smem_addr(&bars.q_buf_empty[qi & 1]));
                } else {
                    if (lane == 0) mbar_arrive(smem_addr(&bars.q_empty));
                }
            }
        }
        if constexpr (T::kPingPong) {
            if (wg == 1) named_bar_arrive(NamedBarrier::kWarpgroupTurn, 0, 256);  // warpgroup 0 takes the first turn
        }
        float alpha[2];

        // Tile 0: S only (no P V before it). Peeled so the loop below issues both products
        // unconditionally: a conditional wgmma let the compiler sink P's packing into the
        // branch, after wgmma.fence, and ptxas then serialised every wgmma (C7514).
        const int slot0 = it0 % T::kStages;
        mbar_wait(smem_addr(&bars.k_full[slot0]), (it0 / T::kStages) & 1);
        if constexpr (T::kPingPong) named_bar_sync(NamedBarrier::kWarpgroupTurn, wg, 256);
        fence_regs(s_acc);
        wgmma_fence();
        issue_qk<T>(s_acc, qr, sQ_wg, sK + slot0 * T::kKBytes);
        if constexpr (T::kPingPong) named_bar_arrive(NamedBarrier::kWarpgroupTurn, 1 - wg, 256);
        wgmma_wait<0>();
        fence_regs(s_acc);
        if (lane == 0) mbar_arrive(smem_addr(&bars.k_empty[slot0]));
        // Persistent, Q from shared memory: its last reader has completed when the tile has one K/V tile (mirrored:
        // released after the tile's loop).
        if constexpr (T::kPersistent && !T::kQInRegs && !T::kStripeMirror) {
            if (lane == 0 && n_tiles == 1) mbar_arrive(smem_addr(&bars.q_empty));
        }
        scores_to_probs<T>(s_acc, m_run, l_run, alpha, kv_first * T::kBlockN, q_row0 + 64 * wg, q_row, seq_k, lane,
                           scale_log2, score_args.softcap_scale, window);
        if constexpr (!T::kSoftmaxOverlap) {
            rescale_and_pack<T>(o_acc, s_acc, alpha, p);
            if constexpr (T::kPSmem) store_p<T>(p, sP_wg, warp_in_wg, lane);
        }
        // softmax_overlap (kSoftmaxOverlap): the loop below is rotated. Written as one iteration (products of tile t,
        // its softmax, the wait for P(t-1) V(t-1), O's rescaling and P's packing), ptxas schedules that wait near the
        // top of the block, above the softmax, which then never runs under its own P V (the SASS has no MUFU.EX2
        // between the waits for S and for P V). Here the wait opens the next iteration, across the back edge
        // from the softmax. The instructions run in the same order as without the knob, so is the output.
        // finish_tile(u): tile u's softmax is done; wait for P(u-1) V(u-1), release V(u-1)'s slot (and refill it
        // without a producer), rescale O and pack P(u). The written loop below repeats it inline with its own slot
        // arithmetic (prev): one helper for both loops, with the slot as a parameter, moved the persistent rotated
        // kernels' register allocation (9 of 100 sampled configs' SASS), so the two stay apart.
        auto finish_tile = [&](int u) {
            wgmma_wait<0>();
            fence_regs(o_acc);
            if constexpr (!T::kPSmem) fence_a_regs(p);
            if (u >= 1) {
                if (lane == 0) mbar_arrive(smem_addr(&bars.v_empty[(it0 + u - 1) % T::kStages]));
                if constexpr (!T::kHasProducer) {
                    if (tid == loader && u - 1 + T::kStages < n_tiles)
                        refill<T>(k_map, v_map, sK, sV, &bars, u - 1, kv_head, batch, kv_first, seq_rows.k);
                    __syncwarp();
                }
            }
            rescale_and_pack<T>(o_acc, s_acc, alpha, p);
            if constexpr (T::kPSmem) store_p<T>(p, sP_wg, warp_in_wg, lane);
        };

        for (int t = 1; t < n_tiles; ++t) {
            if constexpr (T::kSoftmaxOverlap) finish_tile(t - 1);
            // K/V tile t's place in the slots' sequence (lean_addressing: unsigned, no sign fix-up in % and /)
            const typename T::SlotUse use = it0 + t;
            const int slot = use % T::kStages;
            const int prev = (use - 1) % T::kStages;  // tile t-1's slot
            mbar_wait(smem_addr(&bars.k_full[slot]), (use / T::kStages) & 1);
            // V(t-1) left with K(t-1), so it is normally here already. Waiting for it before the
            // fence keeps the spin loop out of the fence-to-wgmma stretch, where ptxas would
            // insert a second fence of its own (C7519).
            mbar_wait(smem_addr(&bars.v_full[prev]), ((use - 1) / T::kStages) & 1);
            if constexpr (T::kPingPong) named_bar_sync(NamedBarrier::kWarpgroupTurn, wg, 256);
            // Everything the two products read from registers is final before the fence.
            fence_regs(s_acc);
            fence_regs(o_acc);
            if constexpr (!T::kPSmem) fence_a_regs(p);
            wgmma_fence();
            issue_qk<T>(s_acc, qr, sQ_wg, sK + slot * T::kKBytes);
            if constexpr (T::kPSmem) issue_pv_smem<T>(o_acc, sP_wg, sV + prev * T::kVBytes);
            else issue_pv<T>(o_acc, p, sV + prev * T::kVBytes);
            if constexpr (T::kPingPong) {
                // Hand the tensor cores to the other warpgroup; warpgroup 1 owes none after its last tile.
                if (wg == 0 || t + 1 < n_tiles) named_bar_arrive(NamedBarrier::kWarpgroupTurn, 1 - wg, 256);
            }
            wgmma_wait<1>();  // S(t) is done; P(t-1) V(t-1) may still run
            //[no_wg_overlap] // Only `tools/time_configs.py --with-flag no_wg_overlap` (no config has it): wait for P(t-1) V(t-1)
            //[no_wg_overlap] // too, so this warpgroup's softmax of tile t no longer runs under its own P V.
            //[no_wg_overlap] wgmma_wait<0>();
            fence_regs(s_acc);
            if (lane == 0) mbar_arrive(smem_addr(&bars.k_empty[slot]));
            // Persistent, Q from shared memory: S(t) of the last K/V tile was Q's last reader, so the next tile's
            // Q may come in under this tile's last softmax, P V and epilogue.
            if constexpr (T::kPersistent && !T::kQInRegs && !T::kStripeMirror) {
                if (lane == 0 && t == n_tiles - 1) mbar_arrive(smem_addr(&bars.q_empty));
            }
            scores_to_probs<T>(s_acc, m_run, l_run, alpha, (kv_first + t) * T::kBlockN, q_row0 + 64 * wg, q_row,
                               seq_k, lane, scale_log2, score_args.softcap_scale, window);
            if constexpr (!T::kSoftmaxOverlap) {
                wgmma_wait<0>();
                fence_regs(o_acc);
                if constexpr (!T::kPSmem) fence_a_regs(p);
                if (lane == 0) mbar_arrive(smem_addr(&bars.v_empty[prev]));
                if constexpr (!T::kHasProducer) {
                    if (tid == loader && t - 1 + T::kStages < n_tiles)
                        refill<T>(k_map, v_map, sK, sV, &bars, t - 1, kv_head, batch, kv_first, seq_rows.k);
                    __syncwarp();
                }
                rescale_and_pack<T>(o_acc, s_acc, alpha, p);
                if constexpr (T::kPSmem) store_p<T>(p, sP_wg, warp_in_wg, lane);
            }
        }
        if constexpr (T::kSoftmaxOverlap) finish_tile(n_tiles - 1);
        // stripe_order = mirrored, Q from shared memory: released after the loop rather than at its last Q K^T. The
        // next tile's Q goes to the other buffer, so this release only gates tile qi + 2's load, and a barrier indexed
        // by qi inside the loop cost the 112-register consumers a spill.
        if constexpr (T::kStripeMirror && !T::kQInRegs) {
            if (lane == 0) mbar_arrive(smem_addr(&bars.q_buf_empty[qi & 1]));
        }
        // P V of the last tile.
        const int last = (it0 + n_tiles - 1) % T::kStages;
        mbar_wait(smem_addr(&bars.v_full[last]), ((it0 + n_tiles - 1) / T::kStages) & 1);
        fence_regs(o_acc);
        if constexpr (!T::kPSmem) fence_a_regs(p);
        wgmma_fence();
        if constexpr (T::kPSmem) issue_pv_smem<T>(o_acc, sP_wg, sV + last * T::kVBytes);
        else issue_pv<T>(o_acc, p, sV + last * T::kVBytes);
        wgmma_wait<0>();
        fence_regs(o_acc);
        if constexpr (!T::kPSmem) fence_a_regs(p);
        if constexpr (T::kPersistent) {
            // The last V slot is free for the next tile's loads.
            if (lane == 0) mbar_arrive(smem_addr(&bars.v_empty[last]));
        }
        if constexpr (T::kCausalWarpgroup && !T::kPersistent) {
            // A later K/V tile of the CTA comes into the slot of this warpgroup's last V.
            if (lane == 0 && n_tiles - 1 + T::kStages < cta_tiles) mbar_arrive(smem_addr(&bars.v_empty[last]));
        }

        epilogue.store(o_acc, m_run, l_run, sink_log2, sQ, sV, wg, q_row0 + 64 * wg, q_row, head, batch, warp_in_wg,
                       lane);
        if constexpr (T::kCausalWarpgroup) {
            // Its output is out; now the K/V tiles past its diagonal (their releases only).
            pass_masked_tiles<T>(&bars, n_tiles, cta_tiles, it0, lane);
        }
    };

    if constexpr (!T::kPersistent) {
        const QTile& w = one_tile;
        const int kv_head = grid_kv_head, n_tiles = grid_range.count;
        if (tid == loader)
            load_first_tiles<T>(q_map, k_map, v_map, sQ, sK, sV, &bars, w, kv_head, n_tiles, grid_range.first, seq_rows);
        __syncwarp();  // the warp reconverges before the .aligned instructions below

        if constexpr (T::kHasProducer) {
            if (tid >= T::kConsumerThreads) {
                if constexpr (T::kSetMaxNReg) setmaxnreg_dec<T::kProducerRegs>();
                if (tid == loader)
                    refill_tiles<T>(k_map, v_map, sK, sV, &bars, kv_head, w.batch, n_tiles, grid_range.first,
                                    seq_rows.k);
                return;
            }
            if constexpr (T::kSetMaxNReg) setmaxnreg_inc<T::kConsumerRegs>();
        }
        consume_tile(w, kv_head, n_tiles, grid_range.first, 0, 0);
    } else {
        // Persistent (hopper/scheduler.cuh): CTA b takes tile b of persistent_tile's order first, then (strided)
        // b + gridDim.x, ... or (kDynamic) the tiles its producer is handed by tile_counter; the consumers walk the
        // same sequence (computed, or read with each Q) and count the K/V tiles before each query tile the same way.
        const int m_blocks = (seq_q + T::kBlockM - 1) / T::kBlockM;
        const int head_batches = n_heads * n_batch;
        const int n_work = m_blocks * head_batches;
        // Causal only (the non-causal order has no sections). K/V heads: the last query head's, plus one.
        const int section =
            T::kIsCausal ? l2_section_pairs<T>(head_batches, seq_k, n_heads / (kv_head_of(n_heads - 1, kv_magic) + 1)) : 1;
        constexpr bool kDynamic = TileHandout<T>::kDynamic;
        __shared__ int handed[TileHandout<T>::kEntries];  // kDynamic: the tiles the producer hands its consumers
        if (tid >= T::kConsumerThreads) {
            if constexpr (T::kSetMaxNReg) setmaxnreg_dec<T::kProducerRegs>();
            if (tid == loader) {
                int it = 0;  // K/V tiles loaded so far
                int qi = 0;  // query tiles so far
                for (int work = blockIdx.x; work < n_work; ++qi) {
                    // The consumers read the tile after q_full's phase qi completes (the Q load's arrival releases
                    // this store). The entry was last read for tile qi - 2, before its Q was released, which the
                    // wait for q_empty at tile qi - 1's Q load saw.
                    hand_tile<T>(handed, qi, work);
                    const QTile w = persistent_tile<T>(work, m_blocks, n_heads, head_batches, section);
                    const int kv_head = kv_head_of(w.head, kv_magic);
                    const KvRange range = kv_tile_range<T>(w.row0, seq_k, window);
                    const int n_tiles = range.count;
                    for (int t = 0; t < n_tiles; ++t, ++it) {
                        // The slot's previous use (it - STAGES) must be released: its K after S, its V after P V.
                        const int slot = it % T::kStages;
                        const int use = it / T::kStages;
                        if (use > 0) mbar_wait(smem_addr(&bars.k_empty[slot]), (use - 1) & 1);
                        load_kv<T, 0>(k_map, sK, &bars, slot, range.first + t, kv_head, w.batch);
                        if (t == 0) load_q<T>(q_map, sQ, smem_base, &bars, qi, w);  // Q after the first K
                        if (use > 0) mbar_wait(smem_addr(&bars.v_empty[slot]), (use - 1) & 1);
                        load_kv<T, 1>(v_map, sV, &bars, slot, range.first + t, kv_head, w.batch);
                    }
                    work = next_tile<T>(tile_counter, work);
                }
                if constexpr (kDynamic) hand_out_end<T>(&bars, handed, qi, tile_counter);
            }
            return;
        }
        if constexpr (T::kSetMaxNReg) setmaxnreg_inc<T::kConsumerRegs>();
        int it = 0, qi = 0;
        for (int work = blockIdx.x;; ++qi) {
            if constexpr (kDynamic) {
                // consume_tile's own wait then passes at once
                if constexpr (T::kStripeMirror) mbar_wait(smem_addr(&bars.q_buf_full[qi & 1]), (qi >> 1) & 1);
                else mbar_wait(smem_addr(&bars.q_full), qi & 1);
                work = handed_tile<T>(handed, qi, tid);
            } else if (qi > 0) {
                work += gridDim.x;
            }
            if (kDynamic ? work < 0 : work >= n_work) break;
            const QTile w = persistent_tile<T>(work, m_blocks, n_heads, head_batches, section);
            const KvRange range = kv_tile_range<T>(w.row0, seq_k, window);
            const int n_tiles = range.count;
            // Q's phase in q_full, or (stripe_order = mirrored) the tile's index, which picks Q's buffer and phase.
            consume_tile(w, kv_head_of(w.head, kv_magic), n_tiles, range.first, it, T::kStripeMirror ? qi : qi & 1);
            it += n_tiles;
        }
        epilogue.finish(tid);
    }
}

}  // namespace hopper
