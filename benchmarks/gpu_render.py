"""The markdown and summary rows of ``gpu_table --quick`` (benchmarks.gpu_quick) from its parts'
JSON: LN against timm per model, every norm against LN (and timm), each norm layer alone, the
profile if run, and everything that was not measured with the reason."""
from __future__ import annotations

import argparse
from typing import Any

def _f(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def _result(parts: dict[str, Any], name: str) -> dict[str, Any]:
    return (parts.get(name) or {}).get("result") or {}


def timm_by_model(parts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """model -> vs_torch's result for it (one or several models in the part's JSON)."""
    res = _result(parts, "vs_torch")
    runs = res.get("models", [res] if res.get("rows") else [])
    return {r["args"]["model"]: r for r in runs}


def summary_rows(parts: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model and norm (or LN variant) measured by the train parts (``train_*``), with
    its ratio to LN (a ratio of medians: from the same process where it has one, else against
    the model's LN row from another process, the FLOP bound recomputed from the analytic counts)
    and to timm eager / compiled (timm's median step from vs_torch over this row's median step:
    above 1 this project is faster). A variants part's own LN row is left out."""
    timm = timm_by_model(parts)
    raw = []
    for part, p in parts.items():
        res = (p or {}).get("result") or {}
        if not part.startswith("train_") or not res.get("rows"):
            continue
        model, a = res["args"]["model"], res["args"]
        tag = "".join(f"+{k}={a[k]}" for k, plain in (("recompute", "none"),
                                                       ("stream_layout", "auto"))
                      if a.get(k) not in (None, plain))
        raw += [(model, {**r, "norm": r["norm"] + tag} if tag else r) for r in res["rows"]
                if not (part.endswith("_variants") and r["norm"] == "layernorm")]
    base = {}
    for model, r in raw:
        if r["norm"] == "layernorm":
            base.setdefault(model, r)
    out = []
    for model, r in raw:
        t = {x["impl"]: x["step_median_s"] for x in timm.get(model, {}).get("rows", [])}
        med, ln = r["step_median_s"], base.get(model)
        ratio, bound, within = r.get("time_ratio_median"), r.get("bound"), r.get("within")
        if ratio is None and ln is not None:
            ratio = med / ln["step_median_s"]
            if "@" not in r["norm"]:
                flops = lambda x: x["model_gflops"] + x["norm_gflops"]
                bound = round(flops(r) / flops(ln) + 0.05, 4)
                within = "yes" if ratio <= bound else "NO"
        out.append({
            "model": model, "norm": r["norm"], "step_s": med, "images_per_s": r["images_per_s"],
            "mfu": r["mfu"], "device_peak_gib": r.get("device_peak_gib"),
            "device_peak_le_gib": r.get("device_peak_le_gib"),
            "xla_peak_gib": r.get("xla_peak_gib"), "ratio_to_ln": ratio, "bound": bound,
            "within": within, "compile_s": r["compile_s"],
            "interleaved": r.get("interleaved_ratio_median"),
            "vs_timm_eager": t["timm"] / med if "timm" in t else None,
            "vs_timm_compiled": t["timm_compiled"] / med if "timm_compiled" in t else None})
    return out


def _peak(r: dict[str, Any]) -> str:
    if r.get("device_peak_gib") is not None:
        return _f(r["device_peak_gib"])
    if r.get("device_peak_le_gib") is not None:
        return "<= " + _f(r["device_peak_le_gib"])
    return _f(r.get("xla_peak_gib")) + " (XLA)" if r.get("xla_peak_gib") is not None else "-"


def headline(parts: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    timm = timm_by_model(parts)
    if not timm:
        return []
    lines = ["| model | this project (LN) | timm eager | timm + torch.compile | speed vs eager | "
             "speed vs compiled | MFU | peak GiB: ours / timm eager / compiled | memory vs compiled |",
             "|" + "---|" * 9]
    for model, res in timm.items():
        r = {x["impl"]: x for x in res["rows"]}
        sp = res.get("speeds", {})
        ln = next((x for x in rows if x["model"] == model and x["norm"] == "layernorm"), {})
        ours = ln.get("device_peak_gib") or res.get("jax_device_peak_gib")
        comp = r.get("timm_compiled", {}).get("peak_gib")
        cell = lambda k: f"{_f(r[k]['step_median_s'])} s, {r[k]['images_per_s']:,.0f} img/s" if k in r else "-"
        speed = lambda k: (f"{sp[k]['median']:.3f}x [{sp[k]['lo']:.3f}, {sp[k]['hi']:.3f}]"
                           if k in sp else "-")
        lines.append(" | ".join(["", model, cell("jax"), cell("timm"), cell("timm_compiled"),
                                 speed("timm"), speed("timm_compiled"), _f(ln.get("mfu")),
                                 f"{_f(ours)} / {_f(r.get('timm', {}).get('peak_gib'))} / {_f(comp)}",
                                 f"{ours / comp:.2f}x" if ours and comp else "-"]).strip() + " |")
    return lines


def norm_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| model | norm | step s | img/s | MFU | peak GiB | ratio to LN | interleaved | bound "
             "| within | vs timm eager | vs timm compiled | compile s |", "|" + "---|" * 13]
    for r in rows:
        lines.append(" | ".join(["", r["model"], r["norm"], _f(r["step_s"], 4),
                                 _f(r["images_per_s"], 5), _f(r["mfu"]), _peak(r),
                                 _f(r["ratio_to_ln"]), _f(r.get("interleaved")), _f(r["bound"]),
                                 _f(r["within"]),
                                 _f(r["vs_timm_eager"]), _f(r["vs_timm_compiled"]),
                                 _f(r["compile_s"])]).strip() + " |")
    return lines


def kernel_table(kern: dict[str, Any]) -> list[str]:
    b, t, c = kern["shape"]
    return ["", f"Each norm layer alone, activation ({b}, {t}, {c}) {kern['args']['dtype']} "
            "(`benchmarks.norm_kernels`; train: forward + backward + statistics, eval: forward; "
            "per-round ratio to LN):", "", "| mode | norm | ms | ratio to LN |", "|---|---|---|---|",
            *[f"| {r['mode']} | {r['norm']} | {r['ms']} | {r['ratio_to_ln']} |" for r in kern["rows"]]]


def profile_tables(prof: dict[str, Any]) -> list[str]:
    a = prof["args"]
    out = ["", f"Profile of one {a['model']} {a['norm']} step (`benchmarks.profile`; device op time "
           f"{_f(prof['op_time_s'] * 1e3)} ms/step, wall {_f(prof['wall_s'] * 1e3)} ms/step, "
           f"{_f(prof.get('matched_share'))} of the traced op time matched to HLO):", ""]
    for key, col in (("by_kind", "kind"), ("by_part", "part")):
        out += [f"| {col} | ms/step | share |", "|---|---|---|"]
        out += [f"| {r[col]} | {_f(r['s_per_step'] * 1e3)} | {_f(r['share'])} |" for r in prof[key]]
        out.append("")
    return out


def not_measured(parts: dict[str, Any]) -> list[str]:
    out = []
    for name, p in parts.items():
        if p.get("status") != "ok":
            out.append(f"- {name}: {p.get('status')}: {p.get('reason')}"
                       + (f" (log {p['log']})" if p.get("log") else ""))
        res = p.get("result") or {}
        for f in res.get("failures", []):
            out.append(f"- {name} {f['norm']}: {f['status']}: {f['reason']}")
        done = {r["norm"] for r in res.get("rows", [])} | {f["norm"] for f in res.get("failures", [])}
        out += [f"- {name} {n}: not reached" for n in res.get("pending", []) if n not in done]
        out += [f"- {name} {m}: not reached" for m in res.get("skipped", [])]
    return out


def markdown(state: dict[str, Any], args: argparse.Namespace) -> str:
    parts = state["parts"]
    rows = state.get("summary", [])
    first = next((_result(parts, n) for n in parts if _result(parts, n).get("machine")), {})
    m = first.get("machine", {})
    tm = (next(iter(timm_by_model(parts).values()), {}) or {}).get("machine", {})
    versions = ", ".join(f"{k} {({**tm, **m})[k]}" for k in
                         ("python", "jax", "jaxlib", "flax", "optax", "torch", "timm") if k in {**tm, **m})
    lines = [f"Measured {m.get('date', '?')} on {m.get('devices', '?')} (host {m.get('host', '?')}, "
             f"{m.get('cores', '?')} cores); {versions}; {m.get('xla', '')}"
             + (f"; XLA_FLAGS += `{args.xla_flags}`" if args.xla_flags else "") + ".",
             f"`gpu_table --quick`: {state.get('elapsed_s', 0):.0f} s of a {args.budget_s:g} s budget. "
             f"Batch {args.batch}, {args.dtype}, {args.num_classes} classes, median of {args.steps} "
             f"steps after {args.warmup}. "
             + ("Each norm in its own process (`train_step --one_process --norm=N`; ratio to LN: "
                "ratio of medians; peak: the device's). " if args.isolate_norms else
                "Norms of a model one after another in one process (`train_step --one_process`; "
                "ratio to LN: ratio of medians; interleaved: then every step again, round-robin, "
                "the median of each round's ratio to LN's; peak: the device's, '<=' where an "
                "earlier norm's peak hides it). ")
             + "compile s: a load from the compilation cache where an earlier part compiled the "
             "same step (LN after vs_torch). timm: `benchmarks.vs_torch` (same ViT, "
             "tanh GELU, grad clipping, fused AdamW, bf16 autocast) alternating with this "
             "project's LN step in one process; speed = timm time / ours per round (above 1: "
             "this project is faster); 'vs timm' in the norm table: timm's median over the row's.",
             ""]
    lines += headline(parts, rows)
    if rows:
        lines += ["", *norm_table(rows)]
    if _result(parts, "norm_kernels").get("rows"):
        lines += kernel_table(_result(parts, "norm_kernels"))
    if _result(parts, "profile").get("by_kind"):
        lines += profile_tables(_result(parts, "profile"))
    missing = not_measured(parts)
    if missing:
        lines += ["", "Not measured:", *missing]
    cmd = "python -m benchmarks.gpu_table --quick" + (f" --variants='{args.variants}'" if args.variants else "")
    lines += ["", f"Command: `{cmd}` (logs and JSON in `{args.out}`)"]
    return "\n".join(lines)
