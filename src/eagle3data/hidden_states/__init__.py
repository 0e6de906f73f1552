"""Stages ``plan_shards``, ``hidden_states`` and ``validate`` (rules/hidden_states.smk):
tokenized conversations -> the target's hidden states in HDF5 shards (the format is
:mod:`eagle3data.shards`) -> a manifest of checked shards.

* :mod:`.settings`: the rules' params, and what only says how to run;
* :mod:`.planning`: the shard plan (a checkpoint), per-shard specs, the disk check;
* :mod:`.extraction`: one shard job: batching, streaming writes;
* :mod:`.backends`: the capture backend config names: :mod:`.transformers_capture`
  (hooks, in-process) or :mod:`.sglang_capture` (SGLang's engine, several ranks), with
  :mod:`.handoff` (rows from the ranks as raw bytes); the engine's processes and their
  cleanup are :mod:`eagle3data.servers`;
* :mod:`.layers`: which decoder layers feed EAGLE-3, in both numbering conventions;
* :mod:`.validation`: the checks and the manifest.
"""
