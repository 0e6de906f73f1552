"""Stages that consume the validated shards (rules/consumers.smk).

* :mod:`.vocab`: the EAGLE-3 draft vocabulary (``d2t``/``t2d``) over all datasets;
* :mod:`.specforge`: the shards as SpecForge's offline ``.ckpt`` files (optional).

Training code reads the shards with :mod:`eagle3data.loader`.
"""
