"""The options of a training run: flags and a TOML file into one frozen, sectioned config.

    python -m trainer.train --config run.toml --tp 2      # the file, then the flags, win in turn

* `trainer.config.options`    `TrainConfig` (its sections and the checks relating them),
                              `parse_args`, `make_config`, `resolve_dp`
* `trainer.config.sections`   the GPT run's sections: model, parallel, optimizer, data,
                              checkpoint (the model's shape and experts: `trainer.model.config`)
* `trainer.config.common`     the sections every trainer shares: checkpoint, logging
* `trainer.config.flags`      flags (and ``--config FILE``) for any config of `trainer.schema`
* `trainer.config.toml_file`  ``--config FILE``: every table, key and type checked
"""
