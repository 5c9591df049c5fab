"""Training configuration: flags, TOML, precedence, and errors that name the key and the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config.options import make_config, parse_args, resolve_dp
from trainer.errors import ConfigError
from trainer.model.config import PRESETS


def toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_defaults_give_the_small_preset_and_derive_dp_later() -> None:
    cfg = parse_args([])
    assert cfg.model.preset == "small" and cfg.gpt == PRESETS["small"] and cfg.parallel.dp == 0


def test_a_toml_file_sets_options_and_model_fields_and_flags_override_it(tmp_path: Path
                                                                         ) -> None:
    path = toml(tmp_path, 'steps = 5\n[optimizer]\nlr = 1\n[model]\npreset = "tiny"\n'
                          'n_layer = 3\n')
    cfg = parse_args(["--config", path, "--steps", "7", "--no-overlap", "--d-model", "128"])
    assert (cfg.model.preset, cfg.steps, cfg.optimizer.lr, cfg.parallel.overlap) == (
        "tiny", 7, 1.0, False)
    assert (cfg.gpt.n_layer, cfg.gpt.d_model, cfg.gpt.seq_len) == (3, 128, PRESETS["tiny"].seq_len)


def test_an_unknown_toml_key_is_rejected_naming_the_key_and_the_file(tmp_path: Path) -> None:
    path = toml(tmp_path, "stesp = 3\n")
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", path])
    assert str(err.value) == (f"unknown config key [{path}: stesp]: 'stesp' is not an option "
                              "of the trainer. Did you mean 'steps'?")


def test_an_unknown_model_key_is_rejected_with_its_table(tmp_path: Path) -> None:
    path = toml(tmp_path, "[model]\nn_layers = 3\n")
    with pytest.raises(ConfigError, match=r"\[.*run.toml: model.n_layers\].*'model.n_layer'"):
        parse_args(["--config", path])


def test_a_wrongly_typed_toml_value_is_rejected(tmp_path: Path) -> None:
    path = toml(tmp_path, 'steps = "3"\n')
    with pytest.raises(ConfigError, match=r"run.toml: steps = '3'\]: expected int, got str"):
        parse_args(["--config", path])


def test_invalid_toml_syntax_names_the_file(tmp_path: Path) -> None:
    path = toml(tmp_path, "steps = = 3\n")
    with pytest.raises(ConfigError, match=r"config file is not valid TOML \[.*run.toml\]"):
        parse_args(["--config", path])


def test_pipeline_parallelism_is_accepted_with_a_balanced_layer_split() -> None:
    cfg = parse_args(["--pp", "2", "--model", "small"])
    par = cfg.parallel
    assert (par.pp, par.schedule, par.virtual_stages, cfg.stage_layers) == (2, "1f1b", 1, (2, 2))
    cfg = resolve_dp(parse_args(["--pp", "2", "--tp", "2", "--global-batch", "8"]), 8)
    assert cfg.parallel.dp == 2


def test_a_model_with_fewer_layers_than_pipeline_stages_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"layers do not split over the pipeline stages "
                                          r"\[n_layer=2, pp=4, virtual stages=1\]"):
        parse_args(["--pp", "4", "--model", "tiny"])


def test_virtual_stages_without_the_interleaved_schedule_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"virtual stages need the interleaved schedule "
                                          r"\[--virtual-stages 2\]: the gpipe schedule"):
        parse_args(["--pp", "2", "--schedule", "gpipe", "--virtual-stages", "2"])


def test_interleaving_with_a_microbatch_count_that_does_not_fit_is_refused_with_options() -> None:
    with pytest.raises(ConfigError) as err:
        parse_args(["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2",
                    "--microbatches", "3", "--global-batch", "6"])
    text = str(err.value)
    assert text.startswith("cannot build the interleaved 1F1B schedule [--pp 2 --microbatches 3 "
                           "--virtual-stages 2]")
    assert "e.g. 2, 4" in text


def test_an_unknown_schedule_and_a_wrong_layer_override_name_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"\[--schedule zb\]: must be one of gpipe, 1f1b"):
        parse_args(["--pp", "2", "--schedule", "zb"])
    with pytest.raises(ConfigError, match=r"\[--pp-layers 2,x\]: it must be comma-separated"):
        parse_args(["--pp", "2", "--pp-layers", "2,x"])
    with pytest.raises(ConfigError, match=r"\[--pp-layers 3,2\]: the counts add up to 5"):
        parse_args(["--pp", "2", "--model", "small", "--pp-layers", "3,2"])


def test_tensor_parallel_size_counts_in_the_derived_dp() -> None:
    assert resolve_dp(parse_args(["--tp", "2", "--global-batch", "8"]), 8).parallel.dp == 4


def test_an_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ConfigError, match=r"unknown model preset \[--model huge\]: choose one of "
                                          "tiny, small, 125m"):
        parse_args(["--model", "huge"])


def test_an_invalid_model_shape_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="must be divisible by n_head"):
        parse_args(["--model", "tiny", "--n-head", "3"])


def test_out_of_range_values_name_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"invalid option \[--microbatches 0\]: must be >= 1"):
        parse_args(["--microbatches", "0"])


def test_dp_defaults_to_the_world_size() -> None:
    assert resolve_dp(make_config({"global_batch": 8}), 4).parallel.dp == 4


def test_a_dp_that_does_not_fill_the_world_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"dp\*tp\*pp = 2 but 4 ranks were started"):
        resolve_dp(make_config({"dp": 2}), 4)


def test_a_global_batch_that_does_not_split_over_dp_and_microbatches_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"\[--global-batch 10\].*dp\*microbatches = 4\*1"):
        resolve_dp(make_config({"global_batch": 10}), 4)


def test_stop_at_ends_the_invocation_early_without_moving_the_schedule() -> None:
    cfg = make_config({"steps": 100, "stop_at": 40})
    assert cfg.last_step == 40 and cfg.decay_end == 100


def test_a_zero_data_cap_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"invalid option \[--data-cap-mb 0.0\]: must be > 0"):
        parse_args(["--data-cap-mb", "0"])


def test_evaluation_without_a_validation_split_is_refused_with_both_ways_out() -> None:
    with pytest.raises(ConfigError, match=r"evaluation without a validation split .*"
                       r"--val-fraction above 0 .*or --eval-every 0"):
        parse_args(["--val-fraction", "0"])
    assert parse_args(["--val-fraction", "0", "--eval-every", "0"]).logging.eval_every == 0


def test_a_model_that_does_not_split_over_tp_is_refused_when_the_options_are_read() -> None:
    with pytest.raises(ConfigError, match=r"\[--tp 4\]: n_head = 2.*not divisible by tp = 4"):
        parse_args(["--model", "tiny", "--tp", "4"])


def test_fewer_ranks_than_tp_times_pp_asks_for_more_ranks_not_for_leaving_out_dp() -> None:
    with pytest.raises(ConfigError, match=r"\[tp=2 pp=2, 2 rank\(s\)\]: one model copy takes "
                       r"tp\*pp = 4 ranks, more than the 2 started. Start a multiple of 4 ranks"):
        resolve_dp(parse_args(["--model", "tiny", "--tp", "2", "--pp", "2"]), 2)


def test_a_world_that_tp_times_pp_does_not_divide_is_refused_with_the_divisor() -> None:
    with pytest.raises(ConfigError, match=r"tp\*pp = 4 ranks, which does not divide the 6 "
                       r"started. Start a multiple of 4 ranks"):
        resolve_dp(parse_args(["--model", "tiny", "--tp", "2", "--pp", "2"]), 6)


def test_a_quiet_parse_prints_nothing_and_keeps_argparse_exit_codes(capsys) -> None:
    for argv, code in ((["--bogus"], 2), (["--help"], 0)):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv, quiet=True)
        assert exit_info.value.code == code
    assert capsys.readouterr() == ("", "")
    with pytest.raises(SystemExit):
        parse_args(["--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
