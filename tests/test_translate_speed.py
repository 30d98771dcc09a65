"""The GPU parts of benchmarks/translate_speed that a CPU can check: the token-budget mode gives every
engine the batches ``aiayn translate`` makes, precisions are refused off CUDA before any work, a
CTranslate2 engine that cannot run on a GPU is reported instead of failing the run, and the GPU table
states its goals (batched >= 3x generate(), batch 1 >= 2x, bf16 vs fp32). Real numbers: BENCHMARKS.md."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("ctranslate2")

from aiayn.config import DecodeOptions  # noqa: E402
from aiayn.search import decode_batches  # noqa: E402
from benchmarks import translate_speed  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tokens_and_batch1_modes(tmp_path):
    """tokens: the translator's batches; batch-1 on the first N sentences; aiayn == generate() in both."""
    result = translate_speed.main(["--smoke", "--threads", "1", "--modes", "batch-1", "tokens", "--batch1-limit", "3",
                                   "--engines", "aiayn", "hf", "--md", str(tmp_path / "B.md"),
                                   "--out-json", str(tmp_path / "s.json")])
    task = translate_speed.smoke_task(8, tmp_path, [])
    want = decode_batches([len(s) + 1 for s in task.sources], DecodeOptions(beam=4, max_tokens=192), "cpu")
    assert len(want) > 1
    res = result["modes"]["tokens"]
    assert res["aiayn"]["batches"] == len(want) and res["hf"]["same_as_aiayn"] == 8
    assert result["modes"]["batch-1"]["hf"]["sentences"] == 3 == result["modes"]["batch-1"]["hf"]["same_as_aiayn"]
    text = (tmp_path / "B.md").read_text()
    assert "token-budget batches of `aiayn translate` (192 tokens" in text and "| tokens | HF generate()" in text


def test_half_precision_off_cuda_is_refused_before_any_work(tmp_path):
    with pytest.raises(SystemExit, match="fp16 needs a CUDA device"):
        translate_speed.main(["--smoke", "--precision", "fp32", "fp16", "--md", str(tmp_path / "B.md")])
    assert not (tmp_path / "B.md").exists()


def test_a_ct2_engine_that_cannot_run_on_a_gpu_is_reported(tmp_path, monkeypatch):
    task = translate_speed.smoke_task(8, tmp_path, ["ct2-fp32", "ct2-bf16"])

    def no_cuda(*a, **k):
        raise RuntimeError("Library libcublas.so.12 is not found or cannot be loaded")

    monkeypatch.setattr(translate_speed, "ct2_engine", no_cuda)
    meta = torch.device("meta")  # stands in for a GPU: nothing is computed while engines are built
    eight = translate_speed.Limit(0.0, 8)  # 8 steps for every source
    fns, checks = translate_speed.build_engines(task, ["aiayn", "ct2-bf16"], 0.6, eight, 1, [0, 1], meta, "bf16")
    assert list(fns) == ["aiayn"] and "libcublas.so.12" in checks["ct2-bf16_not_run"]
    with pytest.raises(RuntimeError):  # on the CPU it is a failure, not a note
        translate_speed.build_engines(task, ["ct2-fp32"], 0.6, eight, 1, [0, 1], torch.device("cpu"), "fp32")
    assert translate_speed.pass_engines(translate_speed.ENGINES, "bf16") == ["aiayn", "aiayn-exact", "aiayn-first",
                                                                             "aiayn-graphs", "hf", "ct2-bf16"]
    assert "aiayn-int8" in translate_speed.pass_engines(translate_speed.ENGINES, "fp32")


def test_gpu_table_states_its_goals():
    def r(sps: float, bleu: float, same: int | None = None) -> dict:
        out = {"sentences": 100, "seconds": 100 / sps, "sentences_per_s": sps, "tokens_per_s": 12 * sps,
               "bleu": bleu}
        return out if same is None else {**out, "same_as_aiayn": same}

    result = {
        "args": {"device": "cuda:0", "alpha": 0.6, "max_len": 100, "warmup_batches": 2, "batch_size": 64,
                 "batch_tokens": 32768, "cudnn_sdpa": "off"},
        "machine": {"platform": "Linux", "cpu": "x", "cores": 16, "threads": 16, "gpu": "NVIDIA H100 80GB HBM3",
                    "python": "3.12", "torch": "2.11"},
        "command": "python -m benchmarks.translate_speed --device cuda", "date": "today", "task": "t",
        "checks": {"hf_max_logit_diff": 1e-5, "ct2-fp32_not_run": "ImportError: no ctranslate2"},
        "modes": {"batch-1": {"aiayn": r(30, 36.0), "hf": r(10, 36.0, 100)},
                  "batched": {"aiayn": r(900, 36.0), "hf": r(300, 36.0, 100)},
                  "batched bf16": {"aiayn": r(1000, 35.6), "hf": r(250, 35.6, 97)}},
    }
    text = translate_speed.markdown(result)
    assert text.startswith("## 2. Translation speed (beam 4, NVIDIA H100 80GB HBM3)")
    assert "CTranslate2 fp32 not run on this device: ImportError: no ctranslate2" in text
    assert "batch-1: aiayn / HF generate() sentences/s = 3.00x (goal >= 2.00x: met)" in text
    assert "batched: aiayn / HF generate() sentences/s = 3.00x (goal >= 3.00x: met)" in text
    assert "batched bf16: aiayn speed vs fp32 = 1.11x (goal >= 1.00x: met); BLEU 35.60 vs 36.00 (goal: within " \
           "0.3: short)" in text
    assert translate_speed.section_name(torch.device("cuda", 0)) == "translate_speed_gpu"
    assert translate_speed.section_name(torch.device("cpu")) == "translate_speed"


def test_cpu_goals_int8_and_one_pass_per_thread_count(tmp_path):
    """Issue 60's CPU table: the exact search against CTranslate2 fp32, int8 against CTranslate2 int8 with its BLEU
    against fp32's, for each thread count, the engines taking turns."""
    md = tmp_path / "B.md"
    result = translate_speed.main(["--smoke", "--threads", "1", "2", "--repeats", "2", "--modes", "batched",
                                   "--engines", "aiayn", "aiayn-exact", "aiayn-int8", "ct2-fp32", "ct2-int8",
                                   "--isolate", "no", "--md", str(md), "--out-json", str(tmp_path / "s.json")])
    assert list(result["modes"]) == ["batched 1t", "batched 2t"]
    assert result["keys"]["batched 2t"] == {"mode": "batched", "precision": "fp32", "threads": 2}
    res = result["modes"]["batched 1t"]
    assert list(res) == ["aiayn", "aiayn-exact", "aiayn-int8", "ct2-fp32", "ct2-int8"]
    assert len(res["aiayn-int8"]["passes_seconds"]) == 2
    assert res["aiayn-int8"]["seconds"] == min(res["aiayn-int8"]["passes_seconds"])
    text = md.read_text()
    for line in ("batched 1t: aiayn (stop=exact) / CTranslate2 fp32 sentences/s = ",
                 "batched 2t: aiayn int8 (stop=exact) / CTranslate2 int8 sentences/s = ",
                 "batched 2t: aiayn int8 BLEU "):
        assert line in text
    assert "| batched 2t | aiayn int8 (stop=exact) |" in text and "fastest of 2 passes" in text


def test_the_parallel_mode_searches_the_batched_modes_batches_side_by_side(tmp_path):
    """The parallel mode: the batched mode's batches, each engine's own way of searching several at once (aiayn's
    workers, CTranslate2's inter_threads); HF has none and is left out; every sentence translated; its rows count for
    the batched work in "each at its fastest". (That aiayn's workers give one thread's translations: test_search.)"""
    md = tmp_path / "B.md"
    result = translate_speed.main(["--smoke", "--limit", "16", "--threads", "2", "--modes", "batched", "parallel",
                                   "--engines", "aiayn-exact", "hf", "ct2-fp32", "--isolate", "no", "--md", str(md),
                                   "--out-json", str(tmp_path / "s.json")])
    assert result["keys"]["parallel"] == {"mode": "parallel", "precision": "fp32", "threads": 2}
    batched, parallel = result["modes"]["batched"], result["modes"]["parallel"]
    assert list(parallel) == ["aiayn-exact", "ct2-fp32"]
    assert parallel["aiayn-exact"]["batches"] == batched["aiayn-exact"]["batches"] == 4  # two workers' worth
    for e in parallel:
        assert parallel[e]["sentences"] == 16 and parallel[e]["target_tokens"] > 0
    text = md.read_text()
    assert "| parallel | aiayn (stop=exact) |" in text and "parallel = those batches searched side by side" in text
    assert "- batched, each at its fastest: aiayn exact (" in text


def test_int8_and_linear_kernel_tables(tmp_path):
    """benchmarks.int8 states int8's BLEU gap against its goal; benchmarks.linear_kernels times every kernel."""
    from benchmarks import int8, linear_kernels

    def side(bleu: float, peak: float) -> dict:
        return {"bleu": bleu, "chrf": 60.0, "wall_s": 5.0, "load_s": 0.1, "first_sentence_s": 0.05,
                "rss_loaded_mib": 260.0, "rss_after_first_mib": 300.0, "peak_rss_mib": peak, "sentences": 1000}

    result = {"fp32": side(35.85, 600.0), "int8": side(35.5, 450.0), "same_outputs": 900,
              "machine": {"platform": "Linux", "cpu": "x", "cores": 2, "threads": 2, "gpu": None, "python": "3.11",
                          "torch": "2.13"},
              "command": "python -m benchmarks.int8", "date": "today",
              "args": {"run_dir": "R", "split": "S", "repeats": 3}}
    text = int8.markdown(result)
    assert "int8 BLEU within 0.3 of fp32: -0.35 (short)" in text and "| peak resident memory" in text
    assert "Same output as fp32: 900/1000" in text
    out = linear_kernels.main(["--threads", "1", "--rounds", "1", "--md", str(tmp_path / "B.md"),
                               "--out-json", str(tmp_path / "k.json")])
    assert len(out["results"]) == len(linear_kernels.SHAPES) * len(linear_kernels.ROWS) + 1  # + the reference
    assert out["results"][-1]["rows"] == linear_kernels.REFERENCE[0]
    assert "| reference: a large square product | 1024x1024 | 1024 |" in (tmp_path / "B.md").read_text()
    assert {"F.linear", "int8"} <= set(out["results"][0]["us"])
    assert "## Linear layers on the CPU" in (tmp_path / "B.md").read_text()
    step = out["step"]  # a whole decoder step's products, weights from beyond the L2 cache
    assert [r["rows"] for r in step["rows"]] == list(linear_kernels.STEP_ROWS) and step["read_gbs"] > 0
    assert {"F.linear", "int8"} <= set(step["rows"][0]["us"])
    assert "| rows | F.linear (ms) |" in (tmp_path / "B.md").read_text()


def test_a_per_source_limit_gives_other_engines_the_batchs_largest():
    """aiayn's limit is int(a * source + b) per sentence (the source with its EOS); HF and CTranslate2 take one per
    batch, the largest, so no sentence of theirs is cut sooner than aiayn's."""
    limit = translate_speed.Limit(1.0, 50)
    assert limit.of([[5, 6, 7], [8]]) == 54 and limit.of([[8]]) == 52
    assert translate_speed.Limit(0.0, 100).of([[5, 6, 7], [8]]) == 100  # the old fixed limit


def test_engines_measured_in_processes_of_their_own_translate_the_same(tmp_path):
    """--isolate: each engine in a fresh interpreter (a worker), as a user runs one; the same outputs and checks as
    in one process, and the table says how it was measured."""
    common = ["--smoke", "--threads", "1", "--modes", "batched", "--engines", "aiayn", "aiayn-exact", "ct2-fp32",
              "--out-json", str(tmp_path / "s.json")]
    one = translate_speed.main([*common, "--isolate", "no", "--md", str(tmp_path / "A.md")])
    own = translate_speed.main([*common, "--isolate", "yes", "--md", str(tmp_path / "B.md")])
    assert own["args"]["isolated"] and not one["args"]["isolated"]
    for e in ("aiayn", "aiayn-exact", "ct2-fp32"):
        a, b = one["modes"]["batched"][e], own["modes"]["batched"][e]
        assert (a["bleu"], a["target_tokens"], a.get("same_as_aiayn")) == (b["bleu"], b["target_tokens"],
                                                                           b.get("same_as_aiayn"))
    assert "each engine in a process of its own" in (tmp_path / "B.md").read_text()
    assert "each engine in a process of its own" not in (tmp_path / "A.md").read_text()


def test_each_engine_is_also_compared_at_its_own_fastest_setting():
    """CTranslate2 may be fastest at fewer threads than aiayn, and aiayn in bf16 or int8: the report pairs each
    engine's best thread count and precision (int8 included, for both), counting a row only if its BLEU is within 0.3
    of the engine's fp32 row."""
    rows = {("batched", "fp32", 1): {"aiayn-exact": (100.0, 30.0), "ct2-fp32": (300.0, 30.1), "ct2-int8": (400, 30.0)},
            ("batched", "fp32", 2): {"aiayn-exact": (240.0, 30.0), "ct2-fp32": (200.0, 30.1)},
            ("batched", "bf16", 1): {"aiayn-exact": (350.0, 30.2)},
            ("batched", "bf16", 2): {"aiayn-exact": (900.0, 29.0)},  # faster, but 1.0 BLEU off: not counted
            ("batch-1", "fp32", 1): {"aiayn-exact": (20.0, 30.0), "ct2-fp32": (50.0, 30.0)},
            ("batch-1", "fp32", 2): {"aiayn-exact": (21.0, 30.0), "aiayn-int8": (30.0, 29.8),
                                     "ct2-fp32": (40.0, 30.0), "ct2-int8": (45.0, 30.1)}}
    result = {"modes": {translate_speed.mode_key(m, q, t): {e: {"sentences_per_s": v, "bleu": b}
                                                              for e, (v, b) in r.items()}
                        for (m, q, t), r in rows.items()},
              "keys": {translate_speed.mode_key(m, q, t): {"mode": m, "precision": q, "threads": t}
                       for m, q, t in rows}}
    assert translate_speed._best_settings(result) == [
        "- batched, each at its fastest: aiayn exact (bf16, 1t) / CTranslate2 (int8, 1t) sentences/s = "
        "0.88x (goal >= 1.00x: short)",
        "- batch-1, each at its fastest: aiayn exact (int8, 2t) / CTranslate2 (fp32, 1t) sentences/s = "
        "0.60x (goal >= 0.50x: met)",
        "- batch-1, each at its fastest: aiayn int8 (int8, 2t) / CTranslate2 int8 (int8, 2t) sentences/s = "
        "0.67x (goal >= 1.00x: short)"]
