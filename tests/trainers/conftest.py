"""The trainers' own code over our exports: one real-model run per session, shared.

The exports are made by the workflow from the real demo model (SmolLM2-135M, greedy, states
in float32 as the CPU demo computes them), so the teacher each trainer computes from them
can be held to the agreement our manifest measured. That run is the session fixture
``exported_run`` of tests/conftest.py (the demo's agreement test reads it too).
"""
