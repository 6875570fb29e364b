"""Views: pure functions from frame tables (pandas) to Plotly figures.

The same functions draw a live session and a loaded bundle. ``tensors`` holds the
rank x tensor views; further modules add their own (collectives swimlanes, ...).
May import ``analysis`` (and ``rank`` column lists); never ``postmortem`` or ``live``.
"""

from workbench.viz.collectives import hang_view, swimlane
from workbench.viz.diagnosis import figure as diagnosis_figure
from workbench.viz.diff import diff_figure
from workbench.viz.sweep import sweep_view
from workbench.viz.tensors import buffer_values, comparison, outputs_view, short, status_matrix, ties_view
from workbench.viz.weightsync import buffer_layout_view, match_matrix_view, output_gap_view, routing_view
from workbench.viz.weightsync_cycles import cycles_view, match_view, order_view

__all__ = [
    "buffer_layout_view", "buffer_values", "comparison", "cycles_view", "diagnosis_figure", "diff_figure", "hang_view",
    "match_matrix_view", "match_view", "order_view", "output_gap_view", "outputs_view", "routing_view", "short",
    "status_matrix", "sweep_view", "swimlane", "ties_view",
]
