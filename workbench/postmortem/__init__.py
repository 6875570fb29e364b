"""What outlives the ranks: run records, ``.wbundle`` files and the HTML report.

Takes records (``RunRecord``), or anything that hands them out through ``records()``
(a live Session or Comparison), and never imports ``live``: a bundle opens on a machine
with no engines and no GPU. May import ``analysis`` and ``viz``.
"""
