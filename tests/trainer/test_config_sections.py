"""Options in sections: declared once with their help (flags and TOML keys read from there),
a file of the earlier flat layout refused with the new place of its keys, the recommender on
the same sections, and the example files of configs/ training as they are."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.support import REPO, dtrain_env
from tests.support.mpi_runs import forked_python, run_ranks
from trainer.config.flags import build_parser
from trainer.config.options import OPTIONS, TrainConfig, make_config, parse_args
from trainer.errors import ConfigError
from trainer.recsys.config import OPTIONS as RECSYS_OPTIONS
from trainer.recsys.config import parse_args as recsys_args

EXAMPLES = sorted((REPO / "configs").glob("*.toml"))


def toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("table", [OPTIONS, RECSYS_OPTIONS], ids=["train", "recsys"])
def test_every_option_has_its_help_one_flag_and_one_toml_key(table) -> None:
    assert all(opt.help for opt in table.values())
    assert len({opt.toml for opt in table.values()}) == len(table)
    assert all(opt.cli == "--" + flag.replace("_", "-") for flag, opt in table.items())


def test_the_help_lists_each_section_with_its_options() -> None:
    text = build_parser(TrainConfig, prog="p", description="d").format_help()
    for table in ("[model]", "[moe]", "[parallel]", "[optimizer]", "[data]", "[checkpoint]",
                  "[logging]"):
        assert table in text
    assert "--moe-experts INT" in text and "experts per MoE layer" in text
    assert "--global-batch INT" in text and "sequences per optimizer step" in text


def test_options_are_read_from_their_sections_and_the_experts_from_moe(tmp_path: Path) -> None:
    path = toml(tmp_path, '[model]\npreset = "tiny"\n[moe]\nexperts = 4\n[parallel]\ntp = 2\n'
                          '[checkpoint]\nkeep = 5\n')
    cfg = parse_args(["--config", path, "--moe-topk", "1"])
    assert (cfg.gpt.moe.experts, cfg.gpt.moe.topk, cfg.parallel.tp, cfg.checkpoint.keep) == (
        4, 1, 2, 5)


def test_a_file_of_the_flat_layout_is_refused_with_the_new_place_of_its_key(tmp_path: Path
                                                                           ) -> None:
    path = toml(tmp_path, "lr = 3e-4\n")
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", path])
    assert str(err.value) == (f"config key moved [{path}: lr]: 'lr' is now 'optimizer.lr'. "
                              "Write it as lr under [optimizer]")
    path = toml(tmp_path, 'model = "tiny"\n')
    with pytest.raises(ConfigError, match=r"'model' is now 'model.preset'"):
        parse_args(["--config", path])


def test_the_gpt_table_of_the_flat_layout_is_refused_naming_model_and_moe(tmp_path: Path
                                                                        ) -> None:
    path = toml(tmp_path, "[gpt]\nn_layer = 3\n")
    with pytest.raises(ConfigError, match=r"config table moved \[.*run.toml: \[gpt\]\]: the "
                                          r"\[gpt\] table of earlier versions is now \[model\] "
                                          r"\(and the moe_ fields to \[moe\]"):
        parse_args(["--config", path])


@pytest.mark.parametrize(("flags", "where"), [
    (["--lr", "inf"], r"\[--lr inf\]: must be a finite number"),
    (["--data-cap-mb", "nan"], r"\[--data-cap-mb nan\]: must be a finite number"),
    (["--seed", str(2**64)], rf"\[--seed {2**64}\]: must be below 2\*\*64"),
    (["--zero", "4"], r"\[--zero 4\]: must be one of 0, 1, 2, 3"),
    (["--moe-experts", "-1"], r"\[--moe-experts -1\]: must be >= 0"),
])
def test_an_option_outside_its_declared_range_is_refused_naming_the_flag(flags, where) -> None:
    with pytest.raises(ConfigError, match=where):
        parse_args(flags)


def test_a_config_records_every_option_by_flag_and_changes_them_by_flag() -> None:
    cfg = make_config({"model": "tiny", "lr": 0.5}, {"n_layer": 3, "moe_experts": 2})
    assert cfg.to_dict()["lr"] == 0.5 and cfg.to_dict()["moe_experts"] == 2
    assert set(cfg.to_dict()) == set(OPTIONS)
    changed = cfg.with_options(tp=2, resume=True, n_layer=4)
    assert (changed.parallel.tp, changed.checkpoint.resume, changed.gpt.n_layer) == (2, True, 4)
    with pytest.raises(ConfigError, match=r"unknown option \[lrr\]"):
        cfg.with_options(lrr=1.0)


def test_the_recommender_reads_the_shared_sections_from_flags_and_toml(tmp_path: Path) -> None:
    path = toml(tmp_path, "[checkpoint]\nkeep = 7\n[logging]\nlog_every = 3\n[data]\n"
                          "global_batch = 64\n")
    cfg = recsys_args(["--config", path, "--optimizer", "adam", "--run-dir",
                       str(tmp_path / "run")])
    assert (cfg.checkpoint.keep, cfg.logging.log_every, cfg.data.global_batch,
            cfg.optimizer.kind) == (7, 3, 64, "adam")


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_each_example_config_trains_as_written(example: Path, tmp_path: Path) -> None:
    """Every file of configs/ runs on the ranks its [parallel] table asks for (shortened by
    flags, which win over the file)."""
    parallel = tomllib.loads(example.read_text()).get("parallel", {})
    ranks = parallel.get("dp", 1) * parallel.get("tp", 1) * parallel.get("pp", 1)
    flags = ["-m", "trainer.train", "--config", str(example), "--steps", "2",
             "--data-cap-mb", "0.25", "--eval-every", "0", "--run-dir", str(tmp_path / "run")]
    if ranks == 1:
        done = subprocess.run([*forked_python(), *flags], cwd=REPO, env=dtrain_env(),
                              capture_output=True, text=True, timeout=300, check=False)
        code, out = done.returncode, done.stdout + done.stderr
    else:
        done = run_ranks(ranks, flags)
        code, out = done.returncode, done.stdout
    assert code == 0, out[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step-2").is_dir()
