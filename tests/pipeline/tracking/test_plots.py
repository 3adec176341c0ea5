"""The run's figures: only drawn when the history holds what they show."""
from pipeline.tracking.plots import history_figure, stage_figure


def _history(stages):
    rows = []
    for epoch in range(3):
        row = {"epoch": epoch, "train_loss": 1.0 / (epoch + 1)}
        for s in range(stages):
            row.update({f"stage{s}/compute_s": 1.0 + s, f"stage{s}/idle_s": 0.5,
                        f"stage{s}/bubble_fraction": 0.5 / (1.5 + s)})
        rows.append(row)
    return rows


def test_stage_figure_has_one_bar_per_stage_and_a_bubble_curve_per_stage():
    fig = stage_figure(_history(3))
    bars, curves = fig.axes[0], fig.axes[1]
    assert [t.get_text() for t in bars.get_xticklabels()] == ["stage 0", "stage 1", "stage 2"]
    assert len(bars.patches) == 6  # compute + idle for each stage
    assert sorted(p.get_height() for p in bars.patches)[-1] == 3 * 3.0  # stage 2: 3 epochs x 3 s compute
    assert [line.get_label() for line in curves.get_lines()] == ["stage 0", "stage 1", "stage 2"]


def test_no_stage_figure_without_pipeline_stages():
    assert stage_figure(_history(0)) is None
    assert history_figure(_history(0)) is not None


def test_the_confusion_figure_stops_growing_with_the_classes():
    import numpy as np

    from pipeline.tracking.plots import confusion_figure

    small = confusion_figure(np.eye(3), ["a", "b", "c"])
    assert small.get_size_inches()[1] == 4.0 and [t.get_text() for t in small.axes[0].get_yticklabels()] == ["a", "b", "c"]
    sizes = []
    for n in (40, 300):
        fig = confusion_figure(np.eye(n), [str(i) for i in range(n)])
        sizes.append(tuple(fig.get_size_inches()))
        labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
        assert (labels == [str(i) for i in range(n)]) == (n == 40)  # 300 labels would overlap: none
    assert sizes[0] == (23.0, 22.0) and sizes[1] == (25.0, 24.0)  # 0.5 inch per class, capped at 24
