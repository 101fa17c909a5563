"""Each normalizer against its ORIGINAL PyTorch module, run side by side on the same inputs.

    python -m benchmarks.originals --src=DIR [--norms=dtn,unified,...] [--json=FILE]

DIR holds the original repositories checked out under their GitHub names; the table in
docs/norms.md ("Checked against the original code") was measured at these commits:

    DIR/DTN                    wqshao126/DTN@f6b43371824d7d0878b339b422c7e71a75367b2a
    DIR/powernorm              sIncerass/powernorm@9ea6226a3203d5d6fcee07a5c6dec38ec6bc5e9f
    DIR/Unified-Normalization  hikvision-research/Unified-Normalization@
                                   0ce9bf26837f94c58ae5dd0d206ad3aa32d82d07
    DIR/SLAB                   xinghaochen/SLAB@f58db00b9db3959b5de03986f454aa5ff064279a
    DIR/DyT                    jiachenzhu/DyT@aab5dde0bc1bdd4410f687dad404c87b31808f90
    DIR/Derf                   zlab-princeton/Derf@8dd9ea3cc70370f423a80a80af6f72466bc621db
    DIR/LearnableScaler        nghiemtuan/LearnableScaler@175086099924a79d63bac63e21daf2cfafcdcd74
    DIR/RescaleViT             ChaofanTao/RescaleViT@3a761cc937681cb1cd782a3d20630e909d850de4

Check each out with ``git clone https://github.com/OWNER/NAME DIR/NAME && git -C DIR/NAME
checkout COMMIT`` (only the one file each case reads is needed: DTN's models/normkit/norms/*.py,
powernorm's fairseq/modules/norms/mask_powernorm.py, Unified-Normalization's
image_classification/models/unified_normalization/unified_normalization.py, SLAB's
classification/models/prepbn.py, DyT's dynamic_tanh.py, Derf's ViT/dynamic_erf.py,
LearnableScaler's timm/layers/norm.py, RescaleViT's models/rescale_mapping.py). A repository or
file that is missing is a skipped row with its reason.

Each case (benchmarks/originals_cases.py) imports ONE file of the original by path, gives the
original module and this project's norm (options from docs/norms.md that reproduce the
reference: eps, unbiased variances, PowerNorm's groups/warmup/backward, DTN's heads...) the same
random parameters, then runs several train steps on random (B, T, C) tokens with channel means
5-15x their spread: forward, gradients of sum(w * y) w.r.t. the input and every parameter (one
random cotangent w per step, the same on both sides), the state after each step (momentum 0.9
here = torch's 0.1), the progressive norm's lambda per step, then the eval forward and, for the
norms that fold, the project's ``inference_affine`` a * x + c against the original's eval. The
originals run in float64 (torch's default dtype set to float64), the project's norms in their
float32 statistics with JAX's x64 on. Rows 'ghost 2x2': the batch of 4 in ghost groups of 2
(``stats_group_size=2``) against two copies of the original sharing their parameters, one per
group as one GPU each, their state set to the copies' mean before each forward (what the
project keeps; DistributedDataParallel's buffer broadcast would give rank 0's). Printed: per
case and quantity the max abs error and the max relative error max|ours - original| /
max|original| over all steps, beside the relative error of the same original run in float32
(float32's own error at that place). Stubs, where an original cannot run as released: the DTN
repository's PowerNorm calls ``PowerFunction``, a name its file renamed to ``PowerFunction_PN``
(bound to it); LearnableScaler's class is run alone (its file belongs to a vendored timm
package). DyT/Derf/DTN import timm (installed with the ``.[torch]`` extra) for functions the
compared modules do not call at these settings.

Needs PyTorch: ``pip install -e '.[torch]'``; without it, one line and exit 2.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any, Sequence

from normvit_jax import cli, tool_flags

PROG = "python -m benchmarks.originals"
# The norms --norms accepts (the first word of a case's row in originals_cases.CASES).
NORMS = ("dtn", "dtn_var", "unified", "powernorm", "repbn", "progressive", "batchnorm", "layernorm",
         "instancenorm", "groupnorm", "scalenorm", "dyt", "derf", "learnable_scaler", "rescale")
INSTALL_HINT = (f"{PROG}: error: needs PyTorch to run the original modules: "
                "pip install -e '.[torch]' (torch==2.14.1)")


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    with cli.tool_errors(PROG):
        return _main(argv)


def _main(argv: Sequence[str] | None) -> list[dict[str, Any]]:
    p = tool_flags.Parser(PROG, __doc__)
    p.add_argument("--src", required=True,
                   help="folder of the original repositories, each under its GitHub name")
    p.add_argument("--norms", default="", help="comma list of norm names (default: all)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    names = [n for n in args.norms.split(",") if n]
    bad = [n for n in names if n not in NORMS]
    if bad:
        p.error(f"--norms: unknown {bad}; accepted: {list(NORMS)}")
    if args.json:
        tool_flags.check_output("json", args.json)
    try:
        import torch
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        sys.exit(2)
    import jax
    jax.config.update("jax_enable_x64", True)
    from benchmarks import originals_cases as oc
    rows = []
    print(f"torch {torch.__version__}, jax {jax.__version__}; originals float64, ours float32 "
          "statistics")
    print("| case | quantity | max abs | max rel | original in float32: max rel |\n"
          "|---|---|---|---|---|")
    for case, (repo, fn) in oc.CASES.items():
        if names and case.split(" ")[0] not in names:
            continue
        t0 = time.perf_counter()
        try:
            err = fn(args.src)
        except oc.Skip as e:
            rows.append({"case": case, "repo": repo, "skipped": str(e)})
            print(f"| {case} | skipped: {e} | - | - | - |")
            continue
        for q, (a, r, r32) in err.q.items():
            rows.append({"case": case, "repo": repo, "quantity": q, "max_abs": a, "max_rel": r,
                         "torch_float32_max_rel": None if r32 != r32 else r32})
            print(f"| {case} | {q} | {a:.1e} | {r:.1e} | {'-' if r32 != r32 else f'{r32:.1e}'} |")
        print(f"({case}: {time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "jax": jax.__version__, "rows": rows}, f,
                      indent=1)
    return rows


if __name__ == "__main__":
    main()
