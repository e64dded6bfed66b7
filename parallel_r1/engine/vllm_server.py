"""vLLM server backend: rollouts on separate nodes through TRL's `VLLMClient`.

Start the server on the rollout node(s) with TRL (which adds the flags TRL needs, among them
`--logprobs-mode processed_logprobs`), e.g.

    trl vllm-serve --model models/sft_seen --tensor-parallel-size 2 --data-parallel-size 2

and give the trainer `use_vllm=True, vllm_mode="server"`: TRL then pushes the policy weights to
the server before every rollout, and `VLLMServerBackend(trainer.vllm_generation.vllm_client)`
sends the segments. `VLLMClient.generate` takes token ids, passes `stop_token_ids`, `seed` and
`logit_bias` through `generation_kwargs` and returns the sampled tokens' log-probs — all the
fork loop needs. Like the offline vLLM backend it decodes with causal attention only.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from parallel_r1.engine.base import SegmentRequest, SegmentResult
from parallel_r1.engine.vllm_backend import BAN_BIAS
from parallel_r1.errors import PipelineError


class VLLMServerBackend:
    """Continue token sequences on a running vLLM server (one HTTP request per segment, in parallel)."""

    def __init__(self, client, max_concurrency: int = 64) -> None:
        self.client = client
        self.max_concurrency = max_concurrency

    @classmethod
    def connect(cls, base_url: str, connection_timeout: float = 0.0, **options) -> VLLMServerBackend:
        """Connect TRL's client to `base_url` (e.g. "http://10.0.0.2:8000")."""
        from trl.generation.vllm_client import VLLMClient

        try:
            client = VLLMClient(base_url=base_url, connection_timeout=connection_timeout)
        except (ConnectionError, ImportError) as err:
            raise PipelineError(f"vLLM server {base_url}: {str(err).splitlines()[0]}") from None
        return cls(client, **options)

    def _one(self, request: SegmentRequest) -> SegmentResult:
        if request.max_new_tokens <= 0:
            return SegmentResult([], [], False)
        extra = {"stop_token_ids": sorted(request.stop_ids), "seed": request.seed, "skip_special_tokens": False}
        if request.banned_ids:
            extra["logit_bias"] = {str(t): BAN_BIAS for t in request.banned_ids}
        try:
            output = self.client.generate(
                [list(request.token_ids)], n=1, temperature=request.temperature, top_p=request.top_p,
                max_tokens=request.max_new_tokens, logprobs=0, generation_kwargs=extra)
        except Exception as err:  # requests/HTTP errors arrive as bare Exceptions from VLLMClient
            raise PipelineError(f"vLLM server {self.client.base_url}: {str(err).splitlines()[0]}") from None
        tokens = list(output["completion_ids"][0])
        logprobs = [values[ids.index(token)] for values, ids, token in
                    zip(output["logprobs"][0], output["logprob_token_ids"][0], tokens)]
        # The client reports no finish reason: a segment shorter than its budget ended on a stop id
        # (ours, or the model's EOS as the server knows it).
        stopped = bool(tokens) and (tokens[-1] in request.stop_ids or len(tokens) < request.max_new_tokens)
        return SegmentResult(tokens, logprobs, stopped)

    def continue_batch(self, requests: Sequence[SegmentRequest]) -> list[SegmentResult]:
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(requests))) as pool:
            return list(pool.map(self._one, requests))

    def sync_weights(self, model) -> None:
        """TRL's GRPOTrainer (vllm_mode="server") already pushes the weights before each rollout."""

    def close(self) -> None:
        self.client = None
