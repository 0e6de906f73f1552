"""Stage ``prompts`` (rules/prompts.smk): prompt sources in their formats -> one
normalised, seeded-order ``results/prompts/{dataset}.parquet`` per dataset.

* :mod:`.sources`: reading JSONL/JSON records in the sharegpt, messages, alpaca and
  prompt formats, with file/line/field errors or recorded skips;
* :mod:`.image_inputs`: the images a record names, read and hashed (the image table is
  :mod:`eagle3data.images`);
* :mod:`.table`: the prompts parquet (schema, writer, reader);
* :mod:`.stage`: the stage function the script calls.
"""
