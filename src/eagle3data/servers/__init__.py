"""Talking to inference engines, below both stages: what generation and capture share about
OpenAI-compatible servers and the engine processes they start.

* :mod:`.http`: retry statuses, error bodies in each server's dialect, the ``/models`` list;
* :mod:`.openai_chat`: the chat-completions body and answer as SGLang, vLLM and llama.cpp
  speak them (tool calls, reasoning, token ids, aborts, over-context errors);
* :mod:`.queue`: the servers' queue gauges (SGLang's ``/v1/loads``, vLLM's ``/metrics``) and
  what of them a client can attribute to itself;
* :mod:`.vllm_files`: the hidden-state files vLLM's capture server writes, read and removed;
* :mod:`.processes` and :mod:`.reaper`: an engine's worker processes, which rank failed and
  what it holds, and the cleanup of what a killed engine leaves.

Neither stage imports the other: ``generation`` (the chat client) and ``hidden_states``
(the capture clients) both build on this package (``tests/project/test_imports.py``).
"""
