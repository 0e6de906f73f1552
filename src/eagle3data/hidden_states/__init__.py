"""Stages ``plan_shards``, ``hidden_states`` and ``validate`` (rules/hidden_states.smk):
tokenized conversations -> the target's hidden states in HDF5 shards (the format is
:mod:`eagle3data.shards`) -> a manifest of checked shards.

* :mod:`.settings`: the rules' params, what only says how to run, and both parsed once
  into :class:`.settings.CaptureSettings` at the job's edge;
* :mod:`.planning`: the shard plan (a checkpoint), per-shard specs, the disk check;
* :mod:`.extraction`: one shard job: batching, streaming writes;
* :mod:`.backends`: the capture backend config names: :mod:`.transformers_capture`
  (hooks, in-process), :mod:`.sglang_capture` (SGLang's engine, several ranks: its
  worker processes :mod:`.sglang_engine`, its forward hooks :mod:`.sglang_hooks`, rows
  from the ranks as raw bytes :mod:`.handoff`) or :mod:`.vllm_capture` (a vLLM server);
  engine processes and their cleanup in general are :mod:`eagle3data.servers`;
* :mod:`.capture_service`: the capture engine a run's shard jobs share (one load per phase);
* :mod:`.layers`: which decoder layers feed EAGLE-3, in both numbering conventions;
* :mod:`.validation`: the checks and the manifest.
"""
