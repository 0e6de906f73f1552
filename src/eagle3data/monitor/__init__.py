"""Watching a run from outside (rules/report.smk, the dry run, ``eagle3data-status``).

* :mod:`.progress`: a dataset's budget prefix so far, from its journal, incrementally;
* :mod:`.preview`: what is left, in tokens and bytes (printed by ``snakemake -n``);
* :mod:`.status`: the ``eagle3data-status`` command;
* :mod:`.report`: the run's pictures and ``summary.html`` (the report rule).
"""
