"""Every figure of the report: accuracy curves, the Δ bar chart and the partition
heatmaps (the paper's Figures 3 and 4). matplotlib is imported when a figure is
drawn, so that the rest of the package starts quickly."""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedspc_app.core.errors import ConfigError, DataError
from fedspc_app.core.files import atomic_write
from fedspc_app.data.partition_files import PARTITION_JSON, load_partition_counts
from fedspc_app.experiments.layout import slug
from fedspc_app.experiments.records import (
    CENTRALIZED,
    FEDERATED,
    GLOBAL_ACCURACY,
    ResultRecord,
    alphas_of,
    cell_stat,
    display_method,
    mean_curve,
    methods_of,
    same_alpha,
    seed_delta_curves,
    seed_deltas,
    settings_of,
    split_title,
    summarize,
    unique,
)


def save_figure(fig: Any, path: Path, *, dpi: int = 120) -> Path:
    """Render ``fig`` to a PNG at ``path`` (written atomically); return ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    atomic_write(path, buffer.getvalue())
    return path


def _panel_axes(count: int, max_cols: int, width: float, height: float) -> tuple[Any, list]:
    """A figure of ``count`` panels, at most ``max_cols`` a row; the unused ones hidden."""
    from matplotlib.figure import Figure

    cols = min(count, max_cols)
    fig = Figure(figsize=(width * cols, height * math.ceil(count / cols)), layout="constrained")
    axes = list(fig.subplots(math.ceil(count / cols), cols, squeeze=False).ravel())
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig, axes[:count]


def _round_panel(ax: Any, method: str, ylabel: str, legend_size: int) -> None:
    """Title, axis labels, grid and legend of a per-round panel of one method."""
    ax.set_title(display_method(method))
    ax.set_xlabel("Round")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)


# ------------------------------------------------------------------- accuracy
def plot_curves(records: Sequence[ResultRecord], setting: str, alpha: float,
                path: str | Path) -> Path | None:
    """Accuracy per round for each method of one (setting, α), base and +FedSPC.

    One panel per method; the lines are means over seeds (shaded ± std). The
    centralized reference of the setting, when there is one, is a dashed line;
    runs with ``evaluate-global-model`` add their global model's accuracy, dotted.
    Complete runs only, as in the tables. Returns None when no complete run of that
    (setting, α) has recorded a round.
    """

    chosen = [r for r in records if r.complete and r.kind == FEDERATED
              and r.setting == setting and same_alpha(r.alpha, alpha) and r.curve]
    methods = methods_of(chosen)
    if not methods:
        return None
    reference = cell_stat(records, method=CENTRALIZED, fedspc=False, alpha=None,
                          setting=setting, kind=CENTRALIZED)
    fig, axes = _panel_axes(len(methods), len(methods) if len(methods) <= 5 else 4, 3.4, 3.0)
    for ax, method in zip(axes, methods):
        for fedspc, colour, label in ((False, "C0", "Base"), (True, "C1", "+FedSPC")):
            runs = [r for r in chosen if r.method == method and r.fedspc == fedspc]
            steps, mean, std = mean_curve(runs)
            if not steps:
                continue
            ax.plot(steps, mean, color=colour, label=label, marker="." if len(steps) < 30
                    else None)
            if any(std):
                ax.fill_between(steps, [m - s for m, s in zip(mean, std)],
                                [m + s for m, s in zip(mean, std)], color=colour, alpha=0.2)
            steps, mean, _ = mean_curve(runs, series=GLOBAL_ACCURACY)
            if steps:
                ax.plot(steps, [100.0 * m for m in mean], color=colour, linestyle=":",
                        label=f"{label}, global model")
        if reference.mean is not None:
            ax.axhline(reference.mean, color="0.4", linestyle="--", linewidth=1,
                       label="Centralized")
        _round_panel(ax, method, "Accuracy (%)", 8)
    fig.suptitle(f"{setting}, {split_title(alpha)}")
    return save_figure(fig, Path(path))


DRIFT_PANELS = (
    ("drift-dispersion", "Drift dispersion", True),
    ("update-cosine", "Mean cosine to the mean update", False),
    ("update-norm", "Norm of the mean update", True),
    ("global-reference-norm", "Norm of ū (FedSPC)", False),
)


def plot_drift(records: Sequence[ResultRecord], setting: str, alpha: float,
               path: str | Path) -> Path | None:
    """The drift diagnostics per round (rows) for each method (columns) of one
    (setting, α), base and +FedSPC; means over the complete runs. None without any."""
    from matplotlib.figure import Figure

    chosen = [r for r in records if r.complete and r.kind == FEDERATED
              and r.setting == setting and same_alpha(r.alpha, alpha)
              and any(key in r.series for key, _, _ in DRIFT_PANELS)]
    methods = methods_of(chosen)
    if not methods:
        return None
    fig = Figure(figsize=(3.2 * len(methods), 2.6 * len(DRIFT_PANELS)), layout="constrained")
    axes = fig.subplots(len(DRIFT_PANELS), len(methods), squeeze=False)
    for col, method in enumerate(methods):
        for row, (key, label, log_scale) in enumerate(DRIFT_PANELS):
            ax = axes[row][col]
            for fedspc, colour, name in ((False, "C0", "Base"), (True, "C1", "+FedSPC")):
                steps, mean, _ = mean_curve((r for r in chosen if r.method == method
                                             and r.fedspc == fedspc), series=key)
                if steps:
                    ax.plot(steps, mean, color=colour, label=name,
                            marker="." if len(steps) < 30 else None)
            if not ax.lines:  # not recorded by this method's runs: no empty panel
                ax.set_visible(False)
                continue
            if log_scale:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            ax.set_xlabel("Round", fontsize=8)
    # Titles on each column's first panel drawn, labels on each row's first one.
    for col, method in enumerate(methods):
        drawn = [axes[row][col] for row in range(len(DRIFT_PANELS))
                 if axes[row][col].get_visible()]
        drawn[0].set_title(display_method(method))
    for row, (_, label, _) in enumerate(DRIFT_PANELS):
        drawn = [ax for ax in axes[row] if ax.get_visible()]
        if drawn:
            drawn[0].set_ylabel(label, fontsize=8)
    fig.suptitle(f"Client drift on the shared block: {setting}, {split_title(alpha)}")
    return save_figure(fig, Path(path))


def plot_deltas(records: Sequence[ResultRecord], path: str | Path) -> Path | None:
    """Δ (+FedSPC − Base, points) per method and α, one panel per setting: a bar at
    the mean over the seeds both sides ran, each seed's Δ as a dot, and ± one sample
    SD of the seeds' Δ as an error bar (two seeds or more); the label gives the mean,
    the SD and the number of seeds. None when no Δ can be computed yet."""
    from matplotlib.figure import Figure

    federated = [r for r in records if r.kind == FEDERATED]
    settings = settings_of(federated)
    methods = [m for m in methods_of(federated) if any(r.method == m and r.fedspc
                                                        for r in federated)]
    alphas = alphas_of(federated)
    values = {
        (s, m, a): [d for _, d in seed_deltas(federated, method=m, alpha=a, setting=s)]
        for s in settings for m in methods for a in alphas
    }
    if not any(values.values()):
        return None
    fig = Figure(figsize=(max(4.0, 1.1 * len(methods) + 1.5) * len(settings), 3.6),
                 layout="constrained")
    # One y scale for all settings, so that their bars compare at a glance.
    axes = fig.subplots(1, len(settings), squeeze=False, sharey=True)[0]
    width = 0.8 / max(len(alphas), 1)
    for ax, setting in zip(axes, settings):
        for i, alpha in enumerate(alphas):
            xs = [j + (i - (len(alphas) - 1) / 2) * width for j in range(len(methods))]
            shown = [(x, values[setting, m, alpha]) for x, m in zip(xs, methods)
                     if values[setting, m, alpha]]
            if not shown:  # an α without any Δ yet gets no bars and no legend entry
                continue
            stats = [summarize(deltas) for _, deltas in shown]
            bars = ax.bar([x for x, _ in shown], [st.mean for st in stats], width=width,
                          label=split_title(alpha), color=f"C{i}", alpha=0.55,
                          yerr=[st.std or 0.0 for st in stats], capsize=3,
                          error_kw={"elinewidth": 0.9})
            for (x, deltas) in shown:
                offsets = [(k - (len(deltas) - 1) / 2) * width * 0.5 / max(len(deltas), 1)
                           for k in range(len(deltas))]
                ax.scatter([x + o for o in offsets], deltas, s=12, color="black",
                           zorder=3)
            ax.bar_label(bars, labels=[_delta_label(st) for st in stats], fontsize=7,
                         padding=2)
        ax.margins(y=0.15)  # room for the value labels
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(methods)))
        ax.set_xticklabels([display_method(m) for m in methods], rotation=30, ha="right")
        ax.set_ylabel("Δ accuracy (points)")
        ax.set_title(setting)
        ax.grid(axis="y", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("FedSPC gain: +FedSPC − Base (final round); dots: seeds, bars: ± SD")
    return save_figure(fig, Path(path))


def plot_delta_curves(records: Sequence[ResultRecord], setting: str, alpha: float,
                      path: str | Path) -> Path | None:
    """Δ per round (+FedSPC − Base, points) for each method of one (setting, α): a thin
    line per seed whose Base and +FedSPC runs are both complete, and over two seeds or
    more their mean in bold with ± one sample SD shaded, on the rounds every seed has.
    Whether a gain lasts or only comes early is read here. None without any such seed."""

    panels = [(method, curves) for method in methods_of(
                  [r for r in records if r.kind == FEDERATED and r.setting == setting])
              if (curves := seed_delta_curves(records, method=method, alpha=alpha,
                                              setting=setting))]
    if not panels:
        return None
    fig, axes = _panel_axes(len(panels), 4, 3.6, 3.0)
    for ax, (method, curves) in zip(axes, panels):
        for seed, curve in curves.items():
            ax.plot(list(curve), list(curve.values()), linewidth=0.9, alpha=0.7,
                    label=f"seed {seed}")
        common = sorted(set.intersection(*(set(c) for c in curves.values())))
        if len(curves) > 1 and common:
            stats = [summarize(c[step] for c in curves.values()) for step in common]
            mean = [st.mean for st in stats]
            ax.plot(common, mean, color="black", linewidth=2,
                    label=f"mean of {len(curves)} seeds")
            ax.fill_between(common, [m - st.std for m, st in zip(mean, stats)],
                            [m + st.std for m, st in zip(mean, stats)], color="0.5",
                            alpha=0.25, label="± SD")
        ax.axhline(0.0, color="black", linewidth=0.8)
        _round_panel(ax, method, "Δ accuracy (points)", 7)
    fig.suptitle(f"+FedSPC − Base per round: {setting}, {split_title(alpha)}")
    return save_figure(fig, Path(path))


def _delta_label(stat) -> str:
    """``+4.50 ± 0.71 (2 seeds)``, ``+4.50 (1 seed)``."""
    spread = f" ± {stat.std:.2f}" if stat.std is not None else ""
    return f"{stat.mean:+.2f}{spread} ({stat.n} seed{'s' if stat.n != 1 else ''})"


def plot_partition_panels(records: Sequence[ResultRecord], out_dir: str | Path
                          ) -> tuple[list[Path], list[str]]:
    """``partitions-<dataset>.png``: per dataset one panel per α, from the cell with
    the smallest seed whose ``partition.json`` can be read (the paper's Figures 3-4).
    Returns the figures and the runs whose partition file could not be read (with
    why), so that one damaged file costs a panel at most, never the report."""
    written: list[Path] = []
    unreadable: list[str] = []
    for dataset in unique(r.dataset for r in records if r.kind == FEDERATED):
        runs = sorted((r for r in records if r.kind == FEDERATED and r.dataset == dataset
                       and r.alpha is not None and r.run_dir is not None
                       and (r.run_dir / PARTITION_JSON).is_file()), key=lambda r: r.seed)
        panels, clients = [], set()
        for alpha in alphas_of(runs):
            data = _first_readable([r for r in runs if r.alpha == alpha], unreadable)
            if data is None:
                continue
            clients.add(int(data["num_clients"]))
            panels.append((split_title(alpha), data["train_counts"]))
        if not panels:
            continue
        title = f"{dataset}: training images per client and class"
        if len(clients) == 1:
            title += f" ({clients.pop()} clients)"
        path = Path(out_dir) / f"partitions-{slug(dataset)}.png"
        written.append(plot_partitions(panels, path, title=title))
    return written, unreadable


def _first_readable(runs: Sequence[ResultRecord], unreadable: list[str]
                    ) -> dict[str, Any] | None:
    """The partition of the first of ``runs`` whose file reads as one; the others
    tried go to ``unreadable``."""
    for run in runs:
        try:
            data = load_partition_counts(run.run_dir)
            _check_counts(data["train_counts"], "train_counts")
        except (DataError, ConfigError) as error:
            unreadable.append(f"{run.name} ({error})")
            continue
        return data
    return None


# ------------------------------------------------------------------- partitions
HEATMAP_DPI = 150


def _check_counts(counts: Any, what: str = "counts") -> np.ndarray:
    array = np.asarray(counts)
    if array.ndim != 2 or 0 in array.shape:
        raise ConfigError(
            f"{what} must be a non-empty [num_clients, num_classes] array, got shape {array.shape}"
        )
    if not np.issubdtype(array.dtype, np.number) or not np.isfinite(array).all():
        raise ConfigError(f"{what} must hold finite numbers")
    if (array < 0).any():
        raise ConfigError(f"{what} must be non-negative")
    return array


def _draw_heatmap(ax: Any, counts: np.ndarray, norm: Any, class_names: Sequence[str] | None) -> Any:
    num_clients, num_classes = counts.shape
    image = ax.imshow(
        counts.T,
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        norm=norm,
        origin="upper",
    )
    ax.set_xlabel("Client")
    ax.set_ylabel("Class")
    x_step = max(1, math.ceil(num_clients / 20))
    ax.set_xticks(np.arange(0, num_clients, x_step))
    if class_names is not None and num_classes <= 50:
        ax.set_yticks(np.arange(num_classes))
        fontsize = 8 if num_classes <= 20 else 6
        ax.set_yticklabels([str(name) for name in class_names], fontsize=fontsize)
    else:
        y_step = max(1, math.ceil(num_classes / 20))
        ax.set_yticks(np.arange(0, num_classes, y_step))
    return image


def _check_class_names(class_names: Sequence[str] | None, num_classes: int) -> None:
    if class_names is not None and len(class_names) != num_classes:
        raise ConfigError(
            f"class_names has {len(class_names)} entries for {num_classes} classes"
        )


def plot_partition(
    counts: np.ndarray,
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    class_names: Sequence[str] | None = None,
) -> Path:
    """Draw ``[num_clients, num_classes]`` counts as a heatmap PNG (the paper's
    Figure 3); ``class_names`` label the class axis when there are at most 50."""
    from matplotlib.figure import Figure

    counts = _check_counts(counts)
    _check_class_names(class_names, counts.shape[1])
    num_clients, num_classes = counts.shape
    fig = Figure(figsize=(min(3 + 0.35 * num_clients, 14), min(3 + 0.06 * num_classes, 14)))
    ax = fig.add_subplot(1, 1, 1)
    image = _draw_heatmap(ax, counts, None, class_names)
    fig.colorbar(image, ax=ax, label="Training images")
    if title:
        ax.set_title(title)
    return save_figure(fig, Path(path), dpi=HEATMAP_DPI)


def plot_partitions(
    panels: list[tuple[str, np.ndarray]],
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    class_names: Sequence[str] | None = None,
) -> Path:
    """Draw ``(title, counts)`` panels side by side (e.g. one per α) on one shared
    colour scale, as in the paper's Figures 3-4; ``class_names`` label the first."""
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    if not panels:
        raise ConfigError("plot_partitions needs at least one panel")
    checked = [(str(name), _check_counts(c, f"counts of panel {name!r}")) for name, c in panels]
    vmax = max(float(c.max()) for _, c in checked)
    norm = Normalize(vmin=0.0, vmax=vmax if vmax > 0 else 1.0)
    max_clients = max(c.shape[0] for _, c in checked)
    max_classes = max(c.shape[1] for _, c in checked)
    width = len(checked) * min(2.5 + 0.3 * max_clients, 8) + 1.5
    height = min(3 + 0.06 * max_classes, 14)
    fig = Figure(figsize=(width, height))
    axes = fig.subplots(1, len(checked), squeeze=False)[0]
    image = None
    for i, (ax, (name, counts)) in enumerate(zip(axes, checked)):
        names = class_names if i == 0 else None
        _check_class_names(names, counts.shape[1])
        image = _draw_heatmap(ax, counts, norm, names)
        ax.set_title(name)
        if i > 0:
            ax.set_ylabel("")
    fig.colorbar(image, ax=list(axes), label="Training images")
    if title:
        fig.suptitle(title)
    return save_figure(fig, Path(path), dpi=HEATMAP_DPI)
