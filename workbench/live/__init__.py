"""Driving live ranks: the engines, the notebook's cluster desk, sessions and the stepper.

``engines`` starts ipyparallel engines, forms the process group and runs functions on
ranks; ``session`` steps a scenario on them and keeps the frames; ``cluster`` puts both
behind ``wb.start()``; ``attach`` puts the same desk on engines someone else launched
(``wb.connect()``); ``registry`` starts, lists and stops clusters in the background;
``stepper`` is the ipywidgets front. This is the only client layer that talks to ranks.
It may import everything below it (``analysis``, ``viz``, ``postmortem``, ``scenarios``,
``rank``); nothing below imports it.
"""
