"""The measures and the report of a diffusion parity run (bench/diffusion_parity.py): each
parameter's gradient difference, the loss curves' agreement "within their noise", and the
markdown and loss-curve PNG of a report. NumPy and matplotlib only: no framework here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SPAN = 20  # steps: the span of the EMA that smooths a loss curve


# --- comparisons ------------------------------------------------------------------------------


def gradient_report(flame: dict, torch: dict, worst: int = 5) -> dict:
    """Per parameter: max |FLAME - PyTorch| / max |PyTorch| (0 where both are all zero)."""
    errors, zero = {}, 0
    for name, expected in torch.items():
        scale = float(np.abs(expected).max())
        difference = float(np.abs(flame[name].astype(np.float64) - expected).max())
        if scale == 0.0 and difference == 0.0:
            zero += 1
        errors[name] = difference / scale if scale > 0 else (0.0 if difference == 0 else np.inf)
    ranked = sorted(errors, key=errors.get, reverse=True)[:worst]
    return {"parameters": len(errors), "zero_in_both": zero, "max": errors[ranked[0]],
            "worst": [{"name": name, "max_rel_diff": errors[name]} for name in ranked]}  # fmt: skip


def smooth(values, span: int = SPAN) -> np.ndarray:
    """EMA of ``values`` (alpha = 2 / (span + 1)), bias-corrected at the start."""
    alpha, level, weight, out = 2.0 / (span + 1), 0.0, 0.0, []
    for value in values:
        level = (1 - alpha) * level + alpha * value
        weight = (1 - alpha) * weight + alpha
        out.append(level / weight)
    return np.array(out)


def agreement(flame: list, torch: list) -> dict:
    """The curves' gap against their noise over the last ``window`` steps (module doc)."""
    flame, torch = np.asarray(flame), np.asarray(torch)
    window = max(1, min(100, len(flame) // 2))
    smooth_flame, smooth_torch = smooth(flame)[-window:], smooth(torch)[-window:]
    gap = float(np.abs(smooth_flame - smooth_torch).mean())
    noise = {"flame": float(np.std(flame[-window:] - smooth_flame)),
             "torch": float(np.std(torch[-window:] - smooth_torch))}  # fmt: skip
    paired = flame[-window:] - torch[-window:]
    relative = np.abs(flame - torch) / np.abs(torch)
    return {"window": window, "span": SPAN, "gap": gap, "noise": noise,
            "gap_over_noise": gap / max(min(noise.values()), 1e-30),
            "within_noise": gap <= min(noise.values()),
            "paired_mean": float(paired.mean()), "paired_std": float(paired.std()),
            "per_step_rel_diff_max": float(relative.max()),
            "per_step_rel_diff_median": float(np.median(relative))}  # fmt: skip


# --- output -----------------------------------------------------------------------------------


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), dpi=120, sharex=True,
                                         gridspec_kw={"height_ratios": [3, 1.3]})  # fmt: skip
    curves = report["curves"]
    steps = np.arange(1, len(curves["flame"]["losses"]) + 1)
    smoothed = {}
    # PyTorch dashed over FLAME: where the curves agree, both stay visible
    styles = (("flame", "C3", "FLAME", "-", 2.2), ("torch", "C0", "PyTorch", "--", 1.2))
    for key, color, name, line, width in styles:
        losses = curves[key]["losses"]
        smoothed[key] = smooth(losses)
        top.plot(steps, losses, color=color, alpha=0.35, linewidth=0.7, linestyle=line)
        top.plot(steps, smoothed[key], color=color, linestyle=line, linewidth=width,
                 label=f"{name} (EMA, span {SPAN}); per step, light")  # fmt: skip
    top.set(ylabel="MSE loss", yscale="log", title=f"{title(report)}: loss curves")
    top.legend()
    gap = np.abs(smoothed["flame"] - smoothed["torch"])
    bottom.plot(steps, gap, color="k", linewidth=0.9, label="|EMA FLAME - EMA PyTorch|")
    noise = min(report["agreement"]["noise"].values())
    bottom.axhline(noise, color="0.5", linestyle="--", label="noise (last window)")
    bottom.set(xlabel="step", yscale="log")
    bottom.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def title(report: dict) -> str:
    setup = report["setup"]
    precision = "bf16 autocast" if setup["bf16"] else "fp32"
    return (f"{setup['model']} {setup['size']} {setup['image']}x{setup['image']} "
            f"b{setup['batch']}, {setup['steps']} steps, {precision}")  # fmt: skip


def number(value, form: str = ".3g") -> str:
    return "-" if value is None else format(value, form)


def gradient_lines(entry: dict, what: str) -> list[str]:
    grads = entry["gradients"]
    lines = [f"{what}: loss FLAME {entry['flame_loss']:.6g}, PyTorch {entry['torch_loss']:.6g}; "
             f"gradients of {grads['parameters']} parameters, {grads['zero_in_both']} all zero "
             f"in both, worst max |diff| / max |PyTorch|:", ""]  # fmt: skip
    lines += ["| parameter | max rel diff |", "| --- | --- |"]
    return lines + [f"| {w['name']} | {w['max_rel_diff']:.2e} |" for w in grads["worst"]] + [""]


def markdown(report: dict) -> str:
    step1, agree, timing = report["step1"], report["agreement"], report["timing_s"]
    curves = report["curves"]
    lines = [f"# Diffusion parity, FLAME vs PyTorch: {title(report)} ({report['device']})", "",
             "Same initial weights (safetensors), batches, timesteps, noise and label dropout "
             "(NumPy); dropout 0; AdamW, warm-up, clip 1.0, warmed-up EMA on both.", "",
             f"Step-1 loss of the training steps: FLAME {step1['flame_step_loss']:.6g}, "
             f"PyTorch {step1['torch_step_loss']:.6g}, |diff| {step1['abs_diff']:.2e} "
             f"(rel {step1['step_rel_diff']:.2e}). Both models start with a zero output layer: "
             "step 1's output is 0, its loss the noise's mean square, and only that layer has "
             "a gradient; hence the second gradient table, at PyTorch's trained weights.",
             ""]  # fmt: skip
    lines += gradient_lines(step1, "Step 1 (initial weights)")
    if "final_gradients" in report:
        lines += gradient_lines(report["final_gradients"], "PyTorch's trained weights, batch 1")
    verdict = "yes" if agree["within_noise"] else "NO"
    lines += [f"Loss curves, last {agree['window']} steps: gap {agree['gap']:.3g} (mean |EMA "
              f"FLAME - EMA PyTorch|), noise FLAME {agree['noise']['flame']:.3g} / PyTorch "
              f"{agree['noise']['torch']:.3g} (std of loss - EMA): gap / noise "
              f"{agree['gap_over_noise']:.2f}, within noise: {verdict}. Paired per-step "
              f"difference {agree['paired_mean']:.2e} +- {agree['paired_std']:.2e}; per-step "
              f"relative difference median {agree['per_step_rel_diff_median']:.2e}, max "
              f"{agree['per_step_rel_diff_max']:.2e}.", ""]  # fmt: skip
    header = ("| system | first step s | wall ms/step after (draws, copies included) | train s "
              "| final loss (mean of 10) |")  # fmt: skip
    lines += [header, "| --- | --- | --- | --- | --- |"]
    for key, name in (("flame", "FLAME"), ("torch", "PyTorch")):
        entry = curves[key]
        lines.append(f"| {name} | {entry['first_step_s']:.2f} | "
                     f"{entry['ms_per_step_after_first']:.1f} | {entry['train_s']:.1f} | "
                     f"{np.mean(entry['losses'][-10:]):.4g} |")  # fmt: skip
    samples = report["samples"]
    lines += ["", f"Samples: DDIM {samples['ddim_steps']} steps, guidance {samples['guidance']}, "
              f"{samples['images']} images from the same noise; mean |pixel diff| "
              f"{samples['mean_abs_pixel_diff']:.3g}.", "",
              "| system | classifier agreement | per-class min | held-out accuracy | s |",
              "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for key, name in (("flame", "FLAME"), ("torch", "PyTorch")):
        quality = samples[key]
        lines.append(f"| {name} | {number(quality['agreement'])} | "
                     f"{number(quality['per_class_agreement_min'])} | "
                     f"{number(quality['classifier_heldout_accuracy'])} | "
                     f"{samples[key + '_s']:.1f} |")  # fmt: skip
    phases = ", ".join(f"{name} {seconds:.1f}" for name, seconds in timing.items())
    lines += ["", f"Wall seconds: {phases}."]
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path) -> str:
    (out / "parity.json").write_text(json.dumps(report, indent=2, default=str))
    text = markdown(report)
    (out / "parity.md").write_text(text)
    plot(report, out / "loss.png")
    return text
