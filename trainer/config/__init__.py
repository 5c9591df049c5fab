"""The options of a training run: flags and a TOML file into one frozen `TrainConfig`.

    python -m trainer.train --config run.toml --tp 2      # the file, then the flags, win in turn

* `trainer.config.options`    `TrainConfig`, `parse_args`, every cross-option check
* `trainer.config.toml_file`  ``--config FILE``: every key and type checked
* `trainer.config.help`       the help text of every option, one ``--help`` line each
"""
