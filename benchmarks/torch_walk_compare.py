"""Compare the ONNX exports of the imported runs with PyTorch's logits (benchmarks/torch_walk_train.py)
on the same uint8 test images, and time the RepBN export folded against unfolded in ONNX Runtime
(2 threads). DIR holds what torch_walk_train wrote and the exports DIR/onnx/<run>/model.onnx of the
imported runs ln, ln_tanh, ln_eps5, ln_eps12, repbn, repbn_tanh (docs/pretrained.md, "Measured with
trained weights", gives their flags), plus ln/folded.onnx and repbn/folded.onnx (--fold):

    python -m benchmarks.torch_walk_compare --dir=DIR
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Sequence

import numpy as np

from normvit_jax import cli, tool_flags

RUNS = {"ln": ["ln/model", "ln/folded", "ln_tanh/model", "ln_eps5/model", "ln_eps12/model"],
        "repbn": ["repbn/model", "repbn/folded", "repbn_tanh/model"]}
ROUNDS, CALLS = 15, 50


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def session(path: str) -> Any:
    import onnxruntime as ort
    o = ort.SessionOptions()
    o.intra_op_num_threads, o.inter_op_num_threads = 2, 1
    return ort.InferenceSession(path, o, providers=["CPUExecutionProvider"])


def spread(v: np.ndarray) -> str:
    return f"{np.median(v):.3f} ({np.percentile(v, 25):.3f}-{np.percentile(v, 75):.3f})"


def compare(d: str) -> None:
    x, y = np.load(os.path.join(d, "test_u8.npy")), np.load(os.path.join(d, "test_y.npy"))
    sessions = {}
    for torch_run, names in RUNS.items():
        t = np.load(os.path.join(d, f"{torch_run}_logits.npy"))
        pt = softmax(t.astype(np.float64))
        print(f"{torch_run}: torch top-1 {(t.argmax(1) == y).mean():.4f}, |logit| max "
              f"{np.abs(t).max():.2f}, std {t.std():.2f}")
        for n in names:
            s = sessions[n] = session(os.path.join(d, "onnx", f"{n}.onnx"))
            p, lg = s.run(["probabilities", "logits"], {"image": x})
            print(f"  {n:18s} top-1 {(lg.argmax(1) == y).mean():.4f}  argmax = torch on "
                  f"{(lg.argmax(1) == t.argmax(1)).sum()}/{len(y)}  max|dlogit| "
                  f"{np.abs(lg - t).max():.2e} (median per image "
                  f"{np.median(np.abs(lg - t).max(1)):.1e})  max|dprob| {np.abs(p - pt).max():.2e}")
    print(f"latency, ONNX Runtime 2 threads, ms per call ({ROUNDS} rounds x {CALLS} calls, order "
          "alternating; median, p25-p75; ratio: median of per-round folded/unfolded):")
    for b in (1, 32):
        xb = x[:b]
        times: dict[str, list[float]] = {n: [] for n in ("repbn/model", "repbn/folded")}
        for n in times:  # warm-up
            for _ in range(10):
                sessions[n].run(["logits"], {"image": xb})
        for r in range(ROUNDS):
            for n in (list(times) if r % 2 == 0 else list(times)[::-1]):
                t0 = time.perf_counter()
                for _ in range(CALLS):
                    sessions[n].run(["logits"], {"image": xb})
                times[n].append((time.perf_counter() - t0) / CALLS * 1e3)
        u, f = np.array(times["repbn/model"]), np.array(times["repbn/folded"])
        print(f"  batch {b}: unfolded {spread(u)}, folded {spread(f)}, folded/unfolded "
              f"{spread(f / u)}")


def main(argv: Sequence[str] | None = None) -> int:
    """Bad input: one line and exit 2, Ctrl-C one line and 130 (docs/faults.md)."""
    with cli.tool_errors("python -m benchmarks.torch_walk_compare"):
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    ap = tool_flags.Parser("python -m benchmarks.torch_walk_compare", __doc__)
    ap.add_argument("--dir", required=True, help="what torch_walk_train wrote, with DIR/onnx/")
    a = ap.parse_args(argv)
    missing = [p for p in ["test_u8.npy", *(f"onnx/{n}.onnx" for ns in RUNS.values() for n in ns)]
               if not os.path.isfile(os.path.join(a.dir, p))]
    if missing:
        print(f"{ap.prog}: error: --dir={a.dir}: missing {', '.join(missing[:3])}"
              f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''} (docs/pretrained.md, "
              "'Measured with trained weights', writes them)", file=sys.stderr)
        return 2
    compare(a.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
