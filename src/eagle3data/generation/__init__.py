"""Stage ``generate`` (rules/generate.smk): the target regenerates every assistant turn,
capped by the dataset's token budget, resumable from an append-only journal.

* :mod:`.stage`: the stage function the script calls;
* :mod:`.settings`: which config keys change the output (the journal key, the rule's
  params) and which only say how to run;
* :mod:`.driver`: order, dispatch, resume, progress and accounting, for every engine;
* :mod:`.budget`: the budget prefix, as pure functions;
* :mod:`.journal`, :mod:`.records`: the journal file and what a record holds;
* :mod:`.engines`: the in-process and HTTP engines, built from config.
"""
