"""``rlalign-verl report``: the dashboard of one or several verl runs' mismatch metrics, offline.

:mod:`.runs` reads and checks the runs (verl's file-logger JSONL, read by :mod:`.jsonl`, or TensorBoard
event directories), :mod:`.page` draws the panels and the self-contained HTML page, :mod:`.tensorboard` reads
event files and writes the custom-scalars layout for TensorBoard itself, :mod:`.output` is the only writer
(inside the directory named, never through a link), :mod:`.command` is the subcommand.
"""
