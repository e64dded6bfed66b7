"""Scoring generated samples and summarising them into one benchmark's metrics.

The rollout engine produces `Sample`s (k responses per problem). `score_sample` checks each
answer with the same rule as the RL reward (`rewards.is_correct`) and reads its parallel
structure (`format`); `summarize` turns the scored samples of one (model, benchmark) into the
metrics file `metrics/eval/<model>/<benchmark>.json`:

- mean@k: accuracy averaged over the samples of each problem, then over problems (the
  paper's mean@16; mean@1 for MATH). When more than k samples exist the mean over all of
  them estimates the same expectation with less variance, so all are used.
- pass@k: the unbiased estimator 1 - C(n-c, k) / C(n, k) of Chen et al. (2021) per problem,
  averaged over problems; with n = k it is simply "any sample right".
- parallel ratio: share of samples with >= 1 well-formed block (Algorithm 1 passes).
- parallel position: where the first `<Parallel>` starts, relative to the response length,
  averaged over the samples that hold a block (None when none does).
- path diversity (beyond the paper): 1 - mean pairwise word-level similarity of a block's
  paths (`format.path_diversity`), averaged over the samples that hold a block.

A generation cut off by the token cap is scored like any other (it is almost always wrong,
having no final answer) and counted as truncated; it is never dropped, since dropping
would flatter the accuracy of models that ramble.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from parallel_r1 import format as fmt
from parallel_r1.errors import PipelineError
from parallel_r1.rewards import is_correct

if TYPE_CHECKING:
    from parallel_r1.prompts import PromptStyle

METRIC_KEYS = (
    "model", "benchmark", "profile", "k", "n_problems", "n_samples", "mean_at_k", "pass_at_k",
    "parallel_ratio", "parallel_position", "path_diversity", "mean_response_tokens", "truncated",
)


def pass_at_k(n: int, c: int, k: int, where: str = "this problem") -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the huge binomials.
    `where` names the problem / benchmark in the error when k > n.
    """
    if k < 1:
        raise PipelineError(f"k={k} must be >= 1 for {where}")
    if k > n:
        raise PipelineError(f"k={k} larger than the n={n} samples generated for {where}")
    if not 0 <= c <= n:
        raise PipelineError(f"c={c} correct samples is outside [0, n={n}] for {where}")
    if n - c < k:
        return 1.0
    failure = 1.0
    for i in range(n - c + 1, n + 1):
        failure *= 1.0 - k / i
    return 1.0 - failure


def mean_at_k(correct_by_problem: Sequence[Sequence[bool]]) -> float:
    """Accuracy averaged over each problem's samples, then over problems."""
    if not correct_by_problem:
        raise PipelineError("mean@k of no problems is undefined")
    return sum(sum(c) / len(c) for c in correct_by_problem) / len(correct_by_problem)


@dataclass(frozen=True)
class Sample:
    """One generated response to one problem, as the rollout engine returns it.

    `response` is the raw text with the parallel tags kept; `truncated` says the
    generation hit the response token cap before it ended.
    """

    problem_id: str
    sample_index: int
    response: str
    ground_truth: str
    answer_kind: str
    completion_tokens: int
    truncated: bool


@dataclass(frozen=True)
class ScoredSample(Sample):
    """A sample with its verdict and parallel structure (one row of the per-sample JSONL)."""

    correct: bool
    parallel: bool
    blocks: int
    parallel_position: float | None
    path_diversity: float | None = None


SAMPLE_FIELDS = tuple(f.name for f in dataclasses.fields(Sample))


def sample_from_row(row: Mapping[str, Any], where: str = "sample row") -> Sample:
    """A `Sample` from a JSON object holding at least the `Sample` fields (extra keys ignored)."""
    missing = [name for name in SAMPLE_FIELDS if name not in row]
    if missing:
        raise PipelineError(f"{where}: missing field(s) {', '.join(missing)}")
    return Sample(**{name: row[name] for name in SAMPLE_FIELDS})


def score_sample(sample: Sample, checker: str = "paper", tokenizer=None) -> ScoredSample:
    """Check the answer and read the blocks; position is token-level when a tokenizer is given.

    An already scored sample is returned unchanged.
    """
    if isinstance(sample, ScoredSample):
        return sample
    parallel = fmt.is_parallel(sample.response)
    position = fmt.parallel_position(sample.response, tokenizer) if parallel else None
    return ScoredSample(
        **{name: getattr(sample, name) for name in SAMPLE_FIELDS},
        correct=is_correct(sample.response, sample.ground_truth, sample.answer_kind, checker),
        parallel=parallel,
        blocks=fmt.count_blocks(sample.response),
        parallel_position=position,
        path_diversity=fmt.path_diversity(sample.response) if parallel else None,
    )


def sample_to_row(sample: Sample, checker: str = "paper", tokenizer=None) -> dict[str, Any]:
    """The per-sample JSONL row: the sample's fields plus correct, parallel, blocks, parallel_position."""
    return dataclasses.asdict(score_sample(sample, checker, tokenizer))


def _group_by_problem(samples: Iterable[ScoredSample], where: str) -> dict[str, list[ScoredSample]]:
    groups: dict[str, list[ScoredSample]] = defaultdict(list)
    seen: set[tuple[str, int]] = set()
    for sample in samples:
        key = (sample.problem_id, sample.sample_index)
        if key in seen:
            raise PipelineError(f"{where}: problem {sample.problem_id!r} has sample_index "
                                f"{sample.sample_index} twice")
        seen.add(key)
        groups[sample.problem_id].append(sample)
    return groups


def summarize(
    samples: Sequence[Sample],
    k: int,
    *,
    model: str,
    benchmark: str,
    profile: str,
    checker: str = "paper",
    tokenizer=None,
) -> dict[str, Any]:
    """The metrics of one (model, benchmark): the METRIC_KEYS plus a few diagnostics.

    `samples` may be plain or already scored; every problem needs at least k of them.
    Rates are fractions in [0, 1].
    """
    where = f"{model}/{benchmark}"
    if not samples:
        raise PipelineError(f"{where}: no samples to evaluate")
    scored = [score_sample(s, checker, tokenizer) for s in samples]
    groups = _group_by_problem(scored, where)
    short = [(pid, len(g)) for pid, g in groups.items() if len(g) < k]
    if short:
        pid, n = short[0]
        raise PipelineError(
            f"{where}: problem {pid!r} has {n} samples, fewer than k={k} "
            f"({len(short)} of {len(groups)} problems are short)"
        )
    correct = [[s.correct for s in g] for g in groups.values()]
    positions = [s.parallel_position for s in scored if s.parallel_position is not None]
    diversities = [s.path_diversity for s in scored if s.path_diversity is not None]
    n_samples = len(scored)
    truncated = sum(s.truncated for s in scored)
    return {
        "model": model,
        "benchmark": benchmark,
        "profile": profile,
        "k": k,
        "n_problems": len(groups),
        "n_samples": n_samples,
        "mean_at_k": mean_at_k(correct),
        "pass_at_k": sum(pass_at_k(len(c), sum(c), k, f"{where} problem {pid!r}")
                         for pid, c in zip(groups, correct, strict=True)) / len(groups),
        "parallel_ratio": sum(s.parallel for s in scored) / n_samples,
        "parallel_position": sum(positions) / len(positions) if positions else None,
        "path_diversity": sum(diversities) / len(diversities) if diversities else None,
        "mean_response_tokens": sum(s.completion_tokens for s in scored) / n_samples,
        "truncated": truncated,
        "truncated_rate": truncated / n_samples,
        "blocks_per_response": sum(s.blocks for s in scored) / n_samples,
        "checker": checker,
        "position_unit": "tokens" if tokenizer is not None else "characters",
    }


@dataclass(frozen=True)
class Job:
    """One sample to generate: the `sample_index`-th response to `problem` of `benchmark`.

    Jobs are the unit the evaluate stage chunks, checkpoints and resumes; `key` names a job's
    sample in a partial file (the problem itself is not stored there).
    """

    benchmark: str
    problem: Mapping[str, Any]
    sample_index: int
    prompt_ids: Sequence[int]

    @property
    def key(self) -> tuple[str, str, int]:
        return self.benchmark, str(self.problem["id"]), self.sample_index


def benchmark_jobs(tokenizer, benchmarks: Mapping[str, tuple[Sequence[Mapping[str, Any]], int]],
                   prompt_style: PromptStyle = "parallel") -> list[Job]:
    """k jobs per problem for {benchmark: (problems, k)}, with the same prompt as training.

    Each problem's prompt is rendered and tokenized once and shared by its k jobs.
    """
    from parallel_r1.prompts import render_prompt

    jobs = []
    for name, (problems, k) in benchmarks.items():
        for problem in problems:
            text = render_prompt(tokenizer, problem["question"], prompt_style)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            jobs += [Job(name, problem, index, ids) for index in range(k)]
    return jobs


def generate_jobs(engine, jobs: Sequence[Job]) -> list[Sample]:
    """One sample per job (in order), all jobs in ONE engine call, whatever their benchmarks.

    Why one call: the engine decodes its rollouts side by side, so a small benchmark (2 AIME
    problems) costs nearly as much wall time alone as together with the others; batching the
    jobs of all benchmarks pays the decode loop once instead of once per benchmark.
    """
    rollouts = engine.generate([job.prompt_ids for job in jobs], 1) if jobs else []
    return [Sample(problem_id=str(job.problem["id"]), sample_index=job.sample_index, response=rollout.text,
                   ground_truth=str(job.problem["ground_truth"]), answer_kind=job.problem["answer_kind"],
                   completion_tokens=len(rollout.completion_ids), truncated=rollout.truncated)
            for job, rollout in zip(jobs, rollouts, strict=True)]


def by_benchmark(jobs: Sequence[Job], samples: Mapping[tuple[str, str, int], Sample],
                 names: Iterable[str]) -> dict[str, list[Sample]]:
    """{benchmark: its samples in job order} from samples keyed by `Job.key`."""
    grouped: dict[str, list[Sample]] = {name: [] for name in names}
    for job in jobs:
        grouped[job.benchmark].append(samples[job.key])
    return grouped
