"""Reading what ranks reported: tables in, facts out.

Frames (rows per rank and tensor), the detectors and their findings, the forward-trace
detector, the collectives ledger and its cross-rank diff, rank grouping for many ranks.
Pure functions on pandas tables, so a live session and a loaded bundle are read by the
same code. May import ``rank`` (column lists), ``scenario`` and ``errors``; never
``viz``, ``postmortem`` or ``live``.
"""
