"""eval/lm_eval.py: the `dgemma` model class, run by lm-evaluation-harness's own evaluator on local JSON tasks (no
network: `dataset_path: json` with absolute data_files), checked against slow references and eval.likelihood."""

import functools
import json
import math
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import lm_eval
import numpy as np
import pytest
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

import dgemma
from dgemma import checkpoints
from dgemma.diffusion import likelihood
from dgemma.errors import ConfigError
from dgemma.model import Transformer, init_cache
from eval import lm_eval as dgemma_lm_eval


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def diffusion_lm(tiny_run):
  return dgemma_lm_eval.dgemma_lm(checkpoint=str(tiny_run[0]), num_t_samples=4, batch_size=8)


@pytest.fixture(scope="module")
def ar_lm(tiny_run):
  """The same weights read as an AR-objective model (its causal encoder scores and decodes)."""
  return dgemma_lm_eval.dgemma_lm(checkpoint=str(tiny_run[0]), batch_size=8, **{"diffusion.objective": "ar"})


def write_task(directory: Path, name: str, docs: list[dict], **task) -> TaskManager:
  """A local lm-eval task: its documents as JSONL, its YAML (JSON is YAML) naming that file by absolute path."""
  directory.mkdir(parents=True, exist_ok=True)
  data = directory / f"{name}.jsonl"
  data.write_text("".join(json.dumps(d) + "\n" for d in docs))
  spec = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
          "test_split": "test", **task}
  (directory / f"{name}.yaml").write_text(json.dumps(spec, indent=1))
  return TaskManager(include_path=str(directory))


def request(kind: str, args: tuple, idx: int = 0) -> Instance:
  return Instance(request_type=kind, doc={}, arguments=args, idx=idx)


def test_choices_of_one_question_share_their_noise(diffusion_lm, monkeypatch):
  """Common random numbers: every canvas of a request is keyed by its context, so (a) the choices of one question
  are scored on the same times and noise, different questions on different ones, and (b) a score does not depend
  on the order of the requests or on the others in the list (keyed by position it would)."""
  pairs = [("the king", " crown"), ("the king", " sword"), ("thou art", " fair")]
  seen = []
  real = likelihood.canvas_scores
  monkeypatch.setattr(likelihood, "canvas_scores", lambda *a, **k: seen.append(np.asarray(k["key_ids"])) or real(*a, **k))
  forward = diffusion_lm.score_continuations(pairs)
  backward = diffusion_lm.score_continuations(pairs[::-1])
  alone = diffusion_lm.score_continuations(pairs[1:2])
  keys = seen[0]  # one canvas per pair (each continuation is shorter than a canvas)
  assert len(keys) == 3 and keys[0] == keys[1] != keys[2]
  assert [s.logprob for s in forward] == [s.logprob for s in backward[::-1]]
  assert alone[0].logprob == forward[1].logprob
  assert all(s.stderr > 0 and not s.is_greedy and s.tokens > 0 for s in forward)


REFERENCE_LEN = 64  # every reference sequence right-padded to this: one compiled program (causal: padding after
                   # the sequence changes nothing before it)


def _full_forward_logp(lm, ids):
  """Slow reference: one causal pass over the whole sequence (positions 0..L-1, no windows), float64 log-probs
  of each next token [L-1, V]."""
  m = lm.model
  L = len(ids)
  tokens = np.zeros((1, REFERENCE_LEN), np.int32)
  tokens[0, :L] = ids
  logits = _reference_logits(m.params, tokens, np.asarray([L]), model_cfg=m.model_cfg)
  return np.asarray(jax.nn.log_softmax(np.asarray(logits[0, :L - 1], np.float64), axis=-1))


@functools.partial(jax.jit, static_argnames=("model_cfg",))
def _reference_logits(params, tokens_BL, lengths_B, *, model_cfg):
  B, L = tokens_BL.shape
  segments = (jnp.arange(L)[None] < lengths_B[:, None]).astype(jnp.int32)
  logits, _ = Transformer(model_cfg).apply({"params": params}, tokens_BL, jnp.broadcast_to(jnp.arange(L), (B, L)),
                                           segments, init_cache(model_cfg, B, L), return_logits=True,
                                           method=Transformer.encode)
  return logits


def test_an_ar_models_loglikelihood_is_its_exact_nll_and_greedy_is_exact(ar_lm):
  """An AR-objective model: loglikelihood = the exact log-probability of the continuation from one full causal
  pass, is_greedy = every continuation token is that pass's argmax (true for a continuation built greedily from
  the reference, false once one token differs). Tolerance: the batched path runs other shapes (left-padded
  windows), so each logit differs by fp32 round-off (~1e-5 relative, ~1e-4 on a token's log-prob); summed over
  <= 20 tokens: rtol 1e-4 with atol 2e-3."""
  tok = ar_lm.model.tokenizer
  context = "the king wore a"
  other = " the crown"
  (logprob, is_greedy), = ar_lm.loglikelihood([request("loglikelihood", (context, other))])
  context_ids, continuation_ids = ar_lm.encode_pair(context, other)
  full = context_ids + continuation_ids
  logp = _full_forward_logp(ar_lm, full)
  np.testing.assert_allclose(logprob, sum(logp[i - 1, full[i]] for i in range(len(context_ids), len(full))),
                             rtol=1e-4, atol=2e-3)
  assert is_greedy == all(int(np.argmax(logp[i - 1])) == full[i] for i in range(len(context_ids), len(full)))
  assert ar_lm.score_continuations([(context, other)])[0].stderr == 0.0
  # greedy by construction (token ids: the untrained model's argmax bytes need not decode to text)
  ids = list(context_ids)
  for _ in range(6):
    ids.append(int(np.argmax(_full_forward_logp(ar_lm, ids + [0])[-1])))
  changed = ids[:-1] + [(ids[-1] + 1) % ar_lm.model.model_cfg.vocab_size]
  scores = ar_lm.score_ids([ids, changed], [len(context_ids)] * 2, [0, 0])
  assert [s.is_greedy for s in scores] == [True, False]
  logp = _full_forward_logp(ar_lm, ids)
  np.testing.assert_allclose(scores[0].logprob, sum(logp[i - 1, ids[i]] for i in range(len(context_ids), len(ids))),
                             rtol=1e-4, atol=2e-3)


def test_a_diffusion_models_loglikelihood_is_eval_likelihoods_bound(diffusion_lm):
  """A 32-byte text after an empty context: its canvases are those eval.likelihood scores for the same text
  (theirs end with one more, holding only EOS), keyed alike (empty context -> key 0 = document 0), so the
  loglikelihood is minus the sum of eval.likelihood's canvas nats but the last; loglikelihood_rolling of the
  text scores the same canvases under other noise. The same rows in the same
  compiled program: equal up to fp32 summation order (rtol 1e-6). Under another eval.seed the estimate moves by
  Monte-Carlo noise only: within 4 combined standard errors, and the reported standard errors describe the
  spread of the estimates over seeds."""
  text = "the king and the queen are fair."
  assert len(diffusion_lm.model.tokenizer.encode(text)) == 32 == 2 * diffusion_lm.model.settings.diffusion.canvas_len
  (logprob, is_greedy), = diffusion_lm.loglikelihood([request("loglikelihood", ("", text))])
  scored = diffusion_lm.model.with_overrides(**{"eval.num_t_samples": 4, "eval.batch_size": 8}).score(text)
  assert len(scored["canvas_nats"]) == 3 and scored["canvas_tokens"] == [16, 16, 1]
  np.testing.assert_allclose(logprob, -sum(scored["canvas_nats"][:2]), rtol=1e-6)
  assert not is_greedy
  estimates, errors = [], []
  for seed in range(12):
    lm = dgemma_lm_eval.dgemma_lm(model=diffusion_lm.model, **{"eval.seed": seed})
    s = lm.score_continuations([("", text)])[0]
    estimates.append(s.logprob), errors.append(s.stderr)
  assert abs(estimates[0] - logprob) < 1e-3 * abs(logprob)  # seed 0 is the default
  for estimate, se in zip(estimates[1:], errors[1:]):
    assert abs(estimate - logprob) < 4 * math.sqrt(se ** 2 + errors[0] ** 2)
  # E[se^2] is the estimate's variance for independent times and at least it for stratified ones; the integrand
  # of an untrained model is heavy-tailed (its 1/t weight near t_eps), so compare with slack: 12 seeds
  spread, rms_se = np.std(estimates, ddof=1), math.sqrt(np.mean(np.square(errors)))
  assert 0.1 * rms_se < spread < 2 * rms_se, (spread, rms_se)
  # loglikelihood_rolling: the same canvases after BOS, keyed by the text: another draw of the same bound
  rolling, = diffusion_lm.loglikelihood_rolling([request("loglikelihood_rolling", (text,))])
  assert rolling != logprob and abs(rolling - logprob) < 4 * math.sqrt(2) * rms_se


def test_an_ar_models_rolling_loglikelihood_is_exact(ar_lm):
  """loglikelihood_rolling of an AR model: the exact log-probability of [BOS] + the text from one full causal pass
  (texts shorter than the context window; tolerance as the loglikelihood test's)."""
  texts = ["the king and the queen are fair", "love and death", "speak hence thou wretched lord of night"]
  tok = ar_lm.model.tokenizer
  for text, got in zip(texts, ar_lm.loglikelihood_rolling([request("loglikelihood_rolling", (t,)) for t in texts])):
    ids = [tok.bos_id] + tok.encode(text)
    logp = _full_forward_logp(ar_lm, ids)
    np.testing.assert_allclose(got, sum(logp[i - 1, ids[i]] for i in range(1, len(ids))), rtol=1e-4, atol=2e-3)


@pytest.mark.slow  # an AR generate program
def test_generate_until_answers_in_request_order_cut_at_until(ar_lm):
  """An AR model at temperature 0 decodes greedily whatever the batching, so each answer must be what
  `Model.generate` gives for its prompt alone, cut at the first of its `until` strings, although the requests
  are batched sorted by prompt length."""
  prompts = ["the king wore a", "love", "thou art the noble lady of the night and", "fair"]
  alone = [ar_lm.model.generate(p, max_new_tokens=8, temperature=0.0).text for p in prompts]
  until = [text[2] for text in alone]  # a character each answer holds: each is cut
  got = ar_lm.generate_until([request("generate_until", (p, {"until": [u], "max_gen_toks": 8, "do_sample": False}))
                              for p, u in zip(prompts, until)])
  assert got == [text[:text.index(u)] for text, u in zip(alone, until)]
  uncut = ar_lm.generate_until([request("generate_until", (p, {"until": [], "max_gen_toks": 8})) for p in prompts])
  assert uncut == alone


def test_chat_template_renders_gemma_turns(diffusion_lm):
  """--apply_chat_template: lm-eval's chat history becomes the Gemma 4 turn text, whose ids (BOS added) are
  exactly those `Model.chat` renders for the same conversation."""
  history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
             {"role": "assistant", "content": "hi"}, {"role": "user", "content": "who art thou"}]
  text = diffusion_lm.apply_chat_template(history)
  assert text.endswith("<|turn>model\n") and "<|turn>model\nhi<turn|>\n" in text
  tok = diffusion_lm.model.tokenizer
  assert [tok.bos_id] + diffusion_lm.encode(text) == diffusion_lm.model.chat_ids(history)


def test_bad_model_arguments_are_one_line_before_weights_are_read(tiny_run, monkeypatch):
  monkeypatch.setattr(checkpoints, "load", lambda *a, **k: pytest.fail("read weights"))
  path = str(tiny_run[0])
  with pytest.raises(ConfigError, match=r"model_args num_t_sample: not an argument .* \(did you mean num_t_samples\?\)"):
    dgemma_lm_eval.dgemma_lm(checkpoint=path, num_t_sample=4)
  with pytest.raises(ConfigError, match=r"model_args temprature: not an argument"):
    dgemma_lm_eval.dgemma_lm(checkpoint=path, temprature=0.5)
  with pytest.raises(ConfigError, match=r"sample\.t_max"):
    dgemma_lm_eval.dgemma_lm(checkpoint=path, **{"sample.t_max": -1.0})
  with pytest.raises(ConfigError, match=r"eval\.num_t_samples"):
    dgemma_lm_eval.dgemma_lm(checkpoint=path, num_t_samples=0)
  with pytest.raises(ConfigError, match=r"batch_size: expected an integer or 'auto'"):
    dgemma_lm_eval.dgemma_lm(checkpoint=path, batch_size="big")
  with pytest.raises(ConfigError, match=r"model_args checkpoint: required"):
    dgemma_lm_eval.dgemma_lm()
  with pytest.raises(Exception, match=r"model_args checkpoint"):
    dgemma_lm_eval.dgemma_lm(checkpoint=str(tiny_run[0].parent / "nope"))


@pytest.fixture(scope="module")
def trained_run(corpus_file, tmp_path_factory):
  """A model that has learnt the toy corpus's bytes: tests/train/test_loop.py's quick run (tiny_test without MoE,
  one decoder pass, lr 2e-3) over 30 steps (~25 s)."""
  from dgemma.train import loop
  from tests.train.test_loop import _quick
  from configs import tiny_test
  config = _quick(tiny_test.get_config())
  tmp = tmp_path_factory.mktemp("lm_eval_run")
  config.data.source, config.data.files, config.data.cache_dir = "files", (str(corpus_file),), str(tmp / "cache")
  config.train.num_steps, config.train.async_checkpointing = 30, False
  loop.train_and_evaluate(config, str(tmp / "wd"))
  return tmp / "wd"


def corpus_questions(num: int, seed: int = 0) -> list[dict]:
  """Which continuation is text of the corpus: a real word of it after four of its words, against two strings of
  the same length from characters it never holds (chance: 1/3)."""
  from tests.conftest import _WORDS
  rnd = random.Random(seed)
  docs = []
  for _ in range(num):
    real = " " + rnd.choice(_WORDS)
    fakes = [" " + "".join(rnd.choice("0123456789QXZJ") for _ in real[1:]) for _ in range(2)]
    label = rnd.randrange(3)
    choices = fakes[:label] + [real] + fakes[label:]
    docs.append({"question": " ".join(rnd.choice(_WORDS) for _ in range(4)), "choices": choices, "label": label})
  return docs


@pytest.mark.slow  # a 30-step training run and lm-eval's evaluator over three tasks
def test_the_command_evaluates_local_tasks_end_to_end(trained_run, tmp_path, capsys):
  """`python -m eval.lm_eval` (its main, in this process) on three local tasks, with lm-eval's own evaluator and
  metrics, each result checked against the model class called directly with the same model arguments:
  - multiple choice (loglikelihood): accuracy = the argmax of the direct loglikelihoods (the requests reach the
    model as (question, choice) and come back in order), and a trained model solves the task (chance 1/3);
  - perplexity (loglikelihood_rolling): bits_per_byte = minus the direct rolling loglikelihoods over the bytes;
  - generation (generate_until, the diffusion sampler): targets that are the direct answers for every other
    document give exact_match 0.5 exactly (answers in request order, the same seeds in the command's model).
  A bad model argument is one line before anything is loaded."""
  from eval.lm_eval import main
  model_args = {"num_t_samples": 4, "batch_size": 8}
  direct = dgemma_lm_eval.dgemma_lm(checkpoint=str(trained_run), **model_args)
  questions = corpus_questions(12)
  texts = ["the king and the queen are fair", "love and death", "speak hence thou wretched lord of night"]
  prompts = ["thou", "the king wore", "the night was long and", "love and death and the crown"]  # distinct lengths
  gen_kwargs = {"until": ["."], "max_gen_toks": 16}
  answers = direct.generate_until([request("generate_until", (p, gen_kwargs)) for p in prompts])
  tasks = tmp_path / "tasks"
  write_task(tasks, "toy_mc", questions, output_type="multiple_choice", doc_to_text="{{question}}",
             doc_to_choice="{{choices}}", doc_to_target="{{label}}", target_delimiter="", metric_list=[{"metric": "acc"}])
  write_task(tasks, "toy_ppl", [{"text": t} for t in texts], output_type="loglikelihood_rolling", doc_to_text="",
             doc_to_target="{{text}}", metric_list=[{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}])
  write_task(tasks, "toy_gen", [{"prompt": p, "answer": a if i % 2 == 0 else a + "#"}
                                for i, (p, a) in enumerate(zip(prompts, answers))],
             output_type="generate_until", doc_to_text="{{prompt}}", doc_to_target="{{answer}}", target_delimiter="",
             generation_kwargs=gen_kwargs, metric_list=[{"metric": "exact_match"}])
  argv = ["--model", "dgemma", "--tasks", "toy_mc,toy_ppl,toy_gen", "--include_path", str(tasks)]

  with pytest.raises(SystemExit) as bad:
    main(argv + ["--model_args", f"checkpoint={trained_run},num_t_sample=2"])
  assert str(bad.value.code).startswith("eval.lm_eval: model_args num_t_sample: not an argument")
  main(argv + ["--model_args", ",".join([f"checkpoint={trained_run}"] + [f"{k}={v}" for k, v in model_args.items()]),
               "--output_path", str(tmp_path / "out")])
  assert "toy_mc" in capsys.readouterr().out
  results, = (tmp_path / "out").rglob("results_*.json")
  results = json.loads(results.read_text())["results"]

  correct = []
  for q in questions:
    logprobs = [s.logprob for s in direct.score_continuations([(q["question"], c) for c in q["choices"]])]
    correct.append(int(np.argmax(logprobs)) == q["label"])
  assert results["toy_mc"]["acc,none"] == pytest.approx(np.mean(correct), abs=1e-12)
  assert results["toy_mc"]["acc,none"] >= 0.9  # chance: 1/3
  rolling = direct.loglikelihood_rolling([request("loglikelihood_rolling", (t,)) for t in texts])
  num_bytes = sum(len(t.encode("utf-8")) for t in texts)
  assert results["toy_ppl"]["bits_per_byte,none"] == pytest.approx(-sum(rolling) / num_bytes / math.log(2), rel=1e-6)
  assert results["toy_gen"]["exact_match,none"] == 0.5
  assert not any("." in a for a in answers)
