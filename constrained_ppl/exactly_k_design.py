"""Framework-free decisions and constants of the exactly-k kernels (``pyro_constrained`` and
``numpyro_constrained``'s ``exactly_k_*`` modules), stated once.

The algorithm is described in docs/distributions/exactly_k_bernoulli.md and
docs/numerics.md ("The exactly-k kernels"); both packages implement the same one: the same
tilt (constants below), power-of-two rescaling of every table, the same rule for taking the
FFT path (``FFT_MIN_VARIANCE``), the same structural bounds on FFT levels, and the same
inverse-CDF split of a node's ones in the sampler. What differs is listed there under
"torch vs JAX", each difference forced by a framework. The path thresholds below are
crossovers of measured run (or compile) times, which depend on the backend (ATen/oneDNN
for torch, XLA for JAX), so each backend has its own; benchmarks/README.md has the
measurements.

Plain Python only: no torch, no JAX, no NumPy.
"""

# --- Tilt (Newton on g(c) = log f(c) - log(m - f(c)), f the tilted expected count) -------

# Steps of the first Newton run: from the bracket [logit(t/m) - max x, logit(t/m) - min x]
# the iteration usually settles after 2 or 3 steps; rows that have not settled by then
# restart from order statistics.
TILT_STEPS = 6
# A step below this leaves the expected count within about 1e-4 of k (Newton converges
# quadratically), far closer than the tables need: any tilt leaves the conditional
# distribution unchanged, the tables only need it roughly right.
TILT_TOLERANCE = 0.1
# A row whose count variance is below this at the result is not settled: the expected
# count can be flat to working precision far from the root (a gap between masked logits),
# so it restarts from order statistics.
TILT_FLAT = 0.1
# The restart's step bound (eager code stops once settled): generous, since bisection alone
# narrows a bracket of width 0.1 * 2^60 below TILT_TOLERANCE in this many steps.
TILT_MAX_STEPS = 60
# The restart's step bound where every step is taken (torch code under torch.jit.trace or
# torch.compile, which cannot stop on a tensor's value): bisection alone narrows a bracket of
# width up to 0.1 * 2^24 (1.7e6) below TILT_TOLERANCE, and a wider one is a gap (above).
# Each step is unrolled in a trace, and TorchScript's optimising pass grows faster than
# linearly with the graph (benchmarks/README.md, "Traced tilt").
TILT_TRACED_STEPS = 24

# --- FFT path ---------------------------------------------------------------------------

# A batch takes the FFT path (wide levels by FFT, errors relative to each table's largest
# entry) only when every row's tilted count variance sum_i sigmoid(x_i) sigmoid(-x_i) is at
# least this: then the entries that the root's entry k and the marginals depend on lie near
# the peak of every table, where an error relative to the largest entry is a relative error.
# Below it the count distribution is nearly deterministic and a leaf's outside ratio
# o_0 / o_1 can fall below the FFT's rounding (docs/numerics.md).
FFT_MIN_VARIANCE = 4.0

# Narrowest product table computed by FFT (crossover of the direct sums and the FFT per
# level, measured on one CPU thread; benchmarks/README.md).
# torch, float64: the in-place shift-and-add direct sums are slower from here.
TORCH_FFT_WIDTH_FLOAT64 = 129
# torch, float32: the direct sums are one oneDNN grouped convolution, faster up to here
# (1.3x to 2.5x at n = 2^19, k_max = 256 to 1024 with FFT levels from 257).
TORCH_FFT_WIDTH_FLOAT32 = 1025
# torch, float64 outside tables (downward correlations) at least this wide go by FFT even
# off the FFT path (3-5x faster than the direct sums from width 33 up): a leaf's outside
# table only needs accuracy relative to its largest entry (see the torch correlation).
TORCH_CORRELATE_FFT_WIDTH_FLOAT64 = 32
# JAX, marginals (a lax.cond between FFT and direct sums per wide level): XLA's direct sums
# stay faster below this width in both dtypes (n = 2^19, k = 100: FFT levels from 129 made
# the marginals 1.3x to 1.9x slower).
JAX_FFT_WIDTH = 513
# JAX, normaliser and draws only (every wide level takes the FFT, no lax.cond): FFT levels
# compile into fewer kernels than the direct sums' loop, so from here (the root's entry k is
# the root's largest entry or near it at any variance, and a draw's split probabilities
# tolerate an absolute error of eps: docs/numerics.md).
JAX_FFT_WIDTH_UNCONDITIONAL = 129


def fft_length(size: int) -> int:
    """The smallest integer >= ``size`` whose prime factors are 2, 3 and 5: transform
    lengths that both frameworks' FFTs (pocketFFT/ducc on CPU, cuFFT on GPU) run fast. The
    same rule as ``pyro.ops.tensor_utils.next_fast_len`` (which the torch kernels call) and
    ``scipy.fftpack.next_fast_len``."""
    size = int(size)
    if size < 1:
        raise ValueError(f"an FFT length must be positive, got {size}")
    while True:
        rest = size
        for prime in (2, 3, 5):
            while rest % prime == 0:
                rest //= prime
        if rest == 1:
            return size
        size += 1


# --- Storage and blocking (torch; JAX lets XLA fuse and tile) ----------------------------

# Tables at most this wide are stored width-major, (batch, width, nodes): the lower levels
# hold many narrow nodes, and each shift of a convolution is then one multiply-add over a
# contiguous slab. Wider ones node-major, (batch, nodes, width).
TORCH_NARROW = 16
# Node-major float64 correlations up to this wide by shifting and adding in place (wider:
# Toeplitz matrix-vector products); float32 convolutions and correlations up to
# TORCH_SHIFT_WIDTH_FLOAT32 (wider: oneDNN's grouped conv1d). Measured per level at
# batch 256, n = 1000 on one CPU thread.
TORCH_SHIFT_WIDTH = 8
TORCH_SHIFT_WIDTH_FLOAT32 = 2
# Bytes of output per block of batch rows, measured best for the direct sums (a block's
# output stays in cache between the passes over it: 2x faster at n = 10000), and for the
# sampler's draws (whose temporaries are several times the output).
TORCH_BLOCK_BYTES = 786432
TORCH_DRAW_BLOCK_BYTES = 3145728
