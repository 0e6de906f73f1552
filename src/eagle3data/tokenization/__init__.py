"""Stage ``tokenize`` (rules/tokenize.smk): responses -> token ids and assistant-only loss
masks, rendered with the target's own chat template (see :mod:`eagle3data.chat`).

* :mod:`.stage`: the stage function the script calls;
* :mod:`.settings`: the rule's params;
* :mod:`.table`: the tokenized parquet (schema, writer, readers).
"""
