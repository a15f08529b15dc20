"""Surrogate-model benchmark of the regression head on three simulated processes.

The protocol of the process-surrogate benchmarks behind Table 6 of Li et al. (the CSTR,
plant and distillation data of Chen et al. 2024): MaxAbs scaling of every input and output
column (fitted on the training rows), a 60/20/20 split into training, validation and test
rows, an MLP with two hidden layers of 32 ReLU units, Adam with learning rate 1e-4 and
batches of 16, a fixed number of epochs, and the test MSE on the scaled outputs, here
averaged over seeds (initialisation and batch order). Data: the simulated processes of
:mod:`constrained_ppl.showcase.processes` (the mixer-CSTR-flash, a distillation column with
tray balances, a reactor network), a few thousand rows each, stored to 7 significant
digits; each with a **random** split (one fixed permutation of the rows) and a
**sequential** one (the rows in campaign order, the last 20% extrapolating).

Methods (every one on the same backbone; the squared errors are sums over the outputs,
averaged over the batch, in the scaled units the test MSE is measured in):

- ``mlp``: the plain MLP, squared error;
- ``projection``: the MLP followed by the orthogonal projection onto ``A y = k`` in the
  scaled units (KKThPINN), trained through the projection;
- ``head``: :func:`numpyro_constrained.nn.head_loss` with its defaults (``loss="mse+nll"``:
  the squared error of the projected prediction, the scale by likelihood;
  ``prediction="projection"``; identity metric, no ``output_loc`` / ``output_scale``),
  calibrated on the validation rows;
- ``head standardised``: the same with ``output_loc`` / ``output_scale`` the training
  mean and standard deviation (the mean layer predicts in units of the standard deviation);
- ``head loc_mse+nll`` (and standardised): the mean trained by the squared error of the
  unprojected ``loc``, a plain regression, and projected afterwards;
- ``head before issue 35``: the recipe the README recommended before (standardised,
  squared error of ``loc`` per training standard deviation, ``metric = 1 / std^2``,
  ``prediction="conditional"``: the ``Sigma^{-1}``-weighted projection);
- ``head nll standardised`` and ``head expected_l2 standardised``: the other losses
  (default prediction);
- ``head per_example``: the default recipe with a heteroscedastic scale (a small MLP on
  the detached features; the mean is trained as in ``head``).

Reported: test MSE (mean and standard error over the seeds, x 1e-4), the largest relative
balance violation ``|A y - k| / (|A| |y| + |k|)`` of the predicted means on the test rows
(in the outputs' own units, float64), and for the heads the coverage of the test rows by
the central 90% intervals (outputs the balances leave free), calibrated on the validation
rows by :func:`~numpyro_constrained.nn.calibrate_head`'s default (split conformal on the
Mahalanobis distance, coverage 0.9); the coverage by the calibrated 90% region (the
ellipsoid on the subspace, the set the conformal guarantee is about); and the per-output
coverage with the maximum-likelihood factor (``method="likelihood"``) and with the default
calibrated on the most recent half of the validation rows only.

Efficiency: the seeds are one ensemble (parameters stacked, ``jax.vmap``), and all epochs of
one process, split and method run as one jitted ``lax.scan``; float32 (x64 off), as NumPyro
users run. Balance rows are normalised to unit norm (the same constraint, better
conditioned in float32).

Run from the repository root: ``python -m benchmarks.surrogate`` (``--help`` for a
smaller configuration; a run with fewer epochs or seeds than the protocol says so in its
header).
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from constrained_ppl.conformal import chi2_quantile  # noqa: E402
from constrained_ppl.showcase.process_simulator import relative_violation  # noqa: E402
from constrained_ppl.showcase.processes import PROCESSES, simulate_process  # noqa: E402
from numpyro_constrained import LinearConstraint  # noqa: E402
from numpyro_constrained.nn import (  # noqa: E402
    calibrate_head,
    head_distribution,
    head_loss,
    init_head,
)

HIDDEN, LR, BATCH = 32, 1e-4, 16
PROTOCOL_EPOCHS, PROTOCOL_SEEDS = 1000, 10
Z90 = 1.6448536269514722
METHODS = (
    "mlp",
    "projection",
    "head",
    "head standardised",
    "head loc_mse+nll",
    "head loc_mse+nll standardised",
    "head before issue 35",
    "head nll standardised",
    "head expected_l2 standardised",
    "head per_example",
)
# name -> (head_loss's loss, prediction, standardise, metric 1 / std^2[, scale])
HEADS = {
    "head": ("mse+nll", "projection", False, False),
    "head standardised": ("mse+nll", "projection", True, False),
    "head loc_mse+nll": ("loc_mse+nll", "projection", False, False),
    "head loc_mse+nll standardised": ("loc_mse+nll", "projection", True, False),
    "head before issue 35": ("loc_mse+nll", "conditional", True, True),
    "head nll standardised": ("nll", "projection", True, False),
    "head expected_l2 standardised": ("expected_l2", "projection", True, False),
    "head per_example": ("mse+nll", "projection", False, False, "per_example"),
}
# The names of the first full run (before the losses were renamed), for --from-json.
_OLD_NAMES = {
    "head projected unstandardised": "head",
    "head projected": "head standardised",
    "head unstandardised": "head loc_mse+nll",
    "head": "head loc_mse+nll standardised",
    "head old recipe": "head before issue 35",
    "head nll": "head nll standardised",
    "head expected_l2": "head expected_l2 standardised",
}


def prepare(process: str, split: str, rows: int) -> dict:
    """Scaled arrays of one process and split, and what the metrics need."""
    data = simulate_process(process, np.random.default_rng(0), rows, ordered=True)
    order = np.arange(rows)
    if split == "random":
        order = np.random.default_rng(1).permutation(rows)
    n_train, n_val = int(0.6 * rows), int(0.2 * rows)
    parts = {
        "train": order[:n_train],
        "val": order[n_train : n_train + n_val],
        "test": order[n_train + n_val :],
    }
    x, y, k, A = data["x"], data["y"], data["k"], data["A"]
    x_max = np.abs(x[parts["train"]]).max(0)
    y_max = np.abs(y[parts["train"]]).max(0)
    # Balances of the scaled outputs: A diag(y_max) (y / y_max) = k, rows normalised.
    A_scaled = A * y_max
    row_norm = np.linalg.norm(A_scaled, axis=1)
    A_scaled, k_scaled = A_scaled / row_norm[:, None], k / row_norm
    out = {"A": A, "A_scaled": A_scaled, "y_max": y_max, "k_raw": k, "y_raw": y}
    for name, index in parts.items():
        out[name] = {
            "x": jnp.asarray(x[index] / x_max, jnp.float32),
            "y": jnp.asarray(y[index] / y_max, jnp.float32),
            "k": jnp.asarray(k_scaled[index], jnp.float32),
            "index": index,
        }
    return out


def init_mlp(key, sizes):
    params = []
    layer_keys = jax.random.split(key, len(sizes) - 1)
    for layer_key, fan_in, fan_out in zip(layer_keys, sizes[:-1], sizes[1:], strict=True):
        bound = 1.0 / np.sqrt(fan_in)
        kw, kb = jax.random.split(layer_key)
        params.append(
            {
                "weight": jax.random.uniform(kw, (fan_out, fan_in), jnp.float32, -bound, bound),
                "bias": jax.random.uniform(kb, (fan_out,), jnp.float32, -bound, bound),
            }
        )
    return params


def backbone(params, x):
    for layer in params:
        x = jax.nn.relu(x @ layer["weight"].T + layer["bias"])
    return x


def adam_init(params):
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return {"m": zeros, "v": zeros, "t": jnp.zeros((), jnp.float32)}


def adam_update(params, grads, opt, lr=LR, b1=0.9, b2=0.999, eps=1e-8):
    t = opt["t"] + 1
    m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, opt["m"], grads)
    v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, opt["v"], grads)
    scale = lr * jnp.sqrt(1 - b2**t) / (1 - b1**t)
    params = jax.tree_util.tree_map(
        lambda p, m, v: p - scale * m / (jnp.sqrt(v) + eps * jnp.sqrt(1 - b2**t)), params, m, v
    )
    return params, {"m": m, "v": v, "t": t}


def make_method(method: str, data: dict, in_features: int):
    """``(init(key) -> params, loss(params, x, k, y), predict(params, x, k) -> (mean, sd))``."""
    n = data["A_scaled"].shape[1]
    constraint = LinearConstraint(jnp.asarray(data["A_scaled"], jnp.float32), rtol=1e-5)
    sizes = (in_features, HIDDEN, HIDDEN)

    if method in ("mlp", "projection"):

        def init(key):
            body_key, out_key = jax.random.split(key)
            return {"body": init_mlp(body_key, sizes), "out": init_mlp(out_key, (HIDDEN, n))[0]}

        def output(params, x, k):
            out = params["out"]
            y = backbone(params["body"], x) @ out["weight"].T + out["bias"]
            return constraint.project(y, k) if method == "projection" else y

        def loss(params, x, k, y):
            return jnp.mean(jnp.sum(jnp.square(output(params, x, k) - y), -1))

        def predict(params, state, x, k):
            return output(params, x, k), None

        return init, loss, predict, None

    loss_name, prediction, standardise, std_metric, *scale = HEADS[method]
    y_train = np.asarray(data["train"]["y"], np.float64)
    options = {"scale": scale[0]} if scale else {}
    if standardise:
        options["output_loc"] = y_train.mean(0)
        options["output_scale"] = np.maximum(y_train.std(0), 1e-6)
    if std_metric:
        options["metric"] = 1.0 / options["output_scale"] ** 2
    _, state = init_head(jax.random.PRNGKey(0), HIDDEN, constraint, **options)

    def init(key):
        body_key, head_key = jax.random.split(key)
        head_params, _ = init_head(head_key, HIDDEN, constraint, **options)
        return {"body": init_mlp(body_key, sizes), "head": head_params}

    def loss(params, x, k, y):
        features = backbone(params["body"], x)
        return head_loss(
            params["head"],
            state,
            features,
            k,
            y,
            loss=loss_name,
            prediction=prediction,
            validate_args=False,
        )

    def predict(params, state, x, k):
        dist = head_distribution(
            params["head"],
            state,
            backbone(params["body"], x),
            k,
            prediction=prediction,
            validate_args=False,
        )
        return dist.mean, jnp.sqrt(dist.variance), dist.scale

    def calibrate(params, x, k, y, method="conformal"):
        return calibrate_head(
            params["head"],
            state,
            backbone(params["body"], x),
            k,
            y,
            prediction=prediction,
            method=method,
            coverage=0.9,
        )

    return init, loss, predict, (state, calibrate)


def train(method, data, epochs, seeds):
    in_features = data["train"]["x"].shape[1]
    init, loss, predict, head = make_method(method, data, in_features)
    train_set = data["train"]
    rows = train_set["x"].shape[0]
    steps = rows // BATCH
    keys = jax.random.split(jax.random.PRNGKey(2024), seeds)
    params = jax.vmap(init)(keys)
    opt = jax.vmap(adam_init)(params)
    grad = jax.grad(loss)

    def step(carry, index):
        params, opt = carry
        x, k, y = train_set["x"][index], train_set["k"][index], train_set["y"][index]
        return adam_update(params, grad(params, x, k, y), opt), None

    def epoch(carry, key):
        order = jax.random.permutation(key, rows)[: steps * BATCH].reshape(steps, BATCH)
        carry, _ = jax.lax.scan(step, carry, order)
        return carry, None

    @jax.jit
    def run(params, opt, keys):
        def one_seed(params, opt, key):
            (params, opt), _ = jax.lax.scan(epoch, (params, opt), jax.random.split(key, epochs))
            return params

        return jax.vmap(one_seed)(params, opt, keys)

    start = time.perf_counter()
    params = jax.block_until_ready(run(params, opt, jax.random.split(jax.random.PRNGKey(7), seeds)))
    seconds = time.perf_counter() - start

    test = data["test"]
    results = {"seconds": seconds}
    if head is None:
        means = jax.vmap(lambda p: predict(p, None, test["x"], test["k"])[0])(params)
    else:
        means = _head_coverage(results, params, predict, head, data, seeds)
    means = np.asarray(means, np.float64)
    results["mse"] = np.mean((means - np.asarray(test["y"], np.float64)[None]) ** 2, axis=(1, 2))
    raw_means = means * data["y_max"]
    k_raw = data["k_raw"][test["index"]]
    results["violation"] = max(relative_violation(data["A"], m, k_raw).max() for m in raw_means)
    return results


# Calibrations compared for every head: the default (split conformal on the validation
# rows), the maximum-likelihood factor, and the default on the most recent half of the
# validation rows (for the sequential split, the half adjacent to the test period).
CALIBRATIONS = {
    "coverage": ("conformal", False),
    "coverage_likelihood": ("likelihood", False),
    "coverage_recent": ("conformal", True),
}


def _head_coverage(results, params, predict, head, data, seeds):
    """Calibrate each seed's head on the validation rows in each way of ``CALIBRATIONS``;
    store the per-seed coverage of the central 90% intervals on the test rows (outputs the
    balances leave free) and, for the default, of the 90% region (the Mahalanobis
    ellipsoid on the subspace, the set the conformal guarantee is about). Returns the
    means."""
    state, calibrate = head
    val, test = data["val"], data["test"]
    recent = slice(val["x"].shape[0] // 2, None)
    d = data["A_scaled"].shape[1] - np.linalg.matrix_rank(data["A_scaled"])
    y = np.asarray(test["y"], np.float64)
    means, coverage = [], {name: [] for name in CALIBRATIONS}
    coverage["coverage_region"] = []
    for i in range(seeds):
        seed_params = jax.tree_util.tree_map(lambda a, i=i: a[i], params)
        mean, sd, scale = (
            np.asarray(v, np.float64) for v in predict(seed_params, state, test["x"], test["k"])
        )
        means.append(mean)
        free = sd.min(0) > 1e-6
        for name, (method, only_recent) in CALIBRATIONS.items():
            rows = recent if only_recent else slice(None)
            calibrated = calibrate(
                seed_params, val["x"][rows], val["k"][rows], val["y"][rows], method
            )
            t = float(calibrated["scale_factor"])
            inside = np.abs(mean - y) <= Z90 * t * sd
            coverage[name].append(inside[:, free].mean())
            if name == "coverage":
                mahalanobis = np.sum(np.square((y - mean) / (t * scale)), -1)
                coverage["coverage_region"].append(np.mean(mahalanobis <= chi2_quantile(0.9, d)))
    results.update({name: np.asarray(value) for name, value in coverage.items()})
    return np.stack(means)


def _row(method: str, r: dict) -> str:
    mse = np.asarray(r["mse"]) * 1e4
    se = mse.std(ddof=1) / np.sqrt(len(mse)) if len(mse) > 1 else float("nan")
    cov = [
        f"{np.mean(r[name]):.3f}" if name in r else "-"
        for name in ("coverage", "coverage_region", "coverage_likelihood", "coverage_recent")
    ]
    return (
        f"| {method} | {mse.mean():.2f} +- {se:.2f} | {float(r['violation']):.1e} | "
        + " | ".join(cov)
        + " |"
    )


def report(summary: dict, processes, splits, methods, header: str) -> None:
    """Print the tables (one per process and split) and the done-when check."""
    print(header + "\n")
    for process in processes:
        for split in splits:
            rows = [m for m in methods if (process, split, m) in summary]
            if not rows:
                continue
            print(f"### {process}, {split} split\n")
            print(
                "| method | test MSE x1e-4 (mean +- se) | max violation | 90% coverage "
                "| 90% region | 90% coverage, ML factor | 90% coverage, recent half |"
            )
            print("| --- | --- | --- | --- | --- | --- | --- |")
            for method in rows:
                print(_row(method, summary[process, split, method]))
            print()
    print("done-when check (`head`, the default recipe, against the baselines; mean test MSE):\n")
    for process in processes:
        for split in splits:
            keys = [(process, split, m) for m in ("head", "projection", "mlp")]
            if not all(key in summary for key in keys):
                continue
            head, proj, mlp = (np.mean(summary[key]["mse"]) for key in keys)
            cov = np.mean(summary[keys[0]]["coverage"])
            checks = {
                # The default recipe trains its mean exactly as the projection layer does, so
                # the two tie up to float32 rounding (the graphs differ by the NLL term).
                "<= projection (to 1e-5 relative)": head <= proj * (1 + 1e-5),
                "< mlp": head < mlp,
                "coverage in [0.85, 0.95]": 0.85 <= cov <= 0.95,
            }
            failed = [name for name, ok in checks.items() if not ok]
            verdict = "met" if not failed else "NOT met (" + ", ".join(failed) + ")"
            print(
                f"- {process}, {split}: head / projection {head / proj:.3f}, head / mlp "
                f"{head / mlp:.3f}, coverage {cov:.3f}: {verdict}"
            )


def _header(rows: int, epochs: int, seeds: int) -> str:
    full = epochs == PROTOCOL_EPOCHS and seeds == PROTOCOL_SEEDS
    label = (
        "the full protocol"
        if full
        else f"REDUCED, not the protocol's {PROTOCOL_EPOCHS} epochs and {PROTOCOL_SEEDS} seeds"
    )
    return (
        f"surrogate benchmark: {rows} rows per process, {epochs} epochs, {seeds} seeds "
        f"({label}); float32"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=PROTOCOL_EPOCHS)
    parser.add_argument("--seeds", type=int, default=PROTOCOL_SEEDS)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--processes", default=",".join(PROCESSES))
    parser.add_argument("--splits", default="random,sequential")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--save", help="write the per-seed results to this .json file")
    parser.add_argument(
        "--from-json",
        nargs="+",
        help="print the tables of saved runs (--save files) instead of training; "
        "--rows / --epochs / --seeds then only label the header",
    )
    args = parser.parse_args(argv)
    processes, splits = args.processes.split(","), args.splits.split(",")
    methods = args.methods.split(",")
    header = _header(args.rows, args.epochs, args.seeds)
    summary = {}
    if args.from_json:
        for path in args.from_json:
            with open(path) as f:
                saved = json.load(f)
            renamed = any(key.endswith("|head projected unstandardised") for key in saved)
            for key, row in saved.items():
                process, split, method = key.split("|")
                if renamed:
                    method = _OLD_NAMES.get(method, method)
                summary[process, split, method] = row
        report(summary, processes, splits, methods, header)
        return
    print(header + f", JAX {jax.__version__}; progress:", flush=True)
    for process in processes:
        for split in splits:
            data = prepare(process, split, args.rows)
            for method in methods:
                r = train(method, data, args.epochs, args.seeds)
                summary[process, split, method] = r
                print(f"{process}, {split}: {_row(method, r)} {r['seconds']:.0f} s", flush=True)
                if args.save:
                    with open(args.save, "w") as f:
                        json.dump(
                            {
                                "|".join(key): {
                                    name: np.asarray(value).tolist() for name, value in row.items()
                                }
                                for key, row in summary.items()
                            },
                            f,
                        )
    print()
    report(summary, processes, splits, methods, header)


if __name__ == "__main__":
    main()
