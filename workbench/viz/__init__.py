"""Views: pure functions from frame tables (pandas) to Plotly figures.

The same functions draw a live session and a loaded bundle. ``tensors`` holds the
rank x tensor views; further modules add their own (collectives swimlanes, ...).
May import ``analysis`` (and ``rank`` column lists); never ``postmortem`` or ``live``.
"""

from workbench.viz.collectives import swimlane
from workbench.viz.diagnosis import figure as diagnosis_figure
from workbench.viz.tensors import buffer_values, comparison, outputs_view, short, status_matrix

__all__ = ["buffer_values", "comparison", "diagnosis_figure", "outputs_view", "short", "status_matrix", "swimlane"]
