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
