"""vLLM server backend: rollouts on separate nodes through TRL's `VLLMClient`.

Start the server on the rollout node(s) with TRL (which adds the flags TRL needs, among them
`--logprobs-mode processed_logprobs`), e.g.

    trl vllm-serve --model models/sft_seen --tensor-parallel-size 2 --data-parallel-size 2

and give the trainer `use_vllm=True, vllm_mode="server"`: TRL then pushes the policy weights to
the server before every rollout (rank 0 only; the rollout function makes every rank wait for it),
and each process's `VLLMServerBackend` sends the segments to the server's OpenAI completions
endpoint, the request `VLLMClient.generate` sends (token ids in, `stop_token_ids`, `seed`,
`logit_bias`, sampled log-probs out), but read here directly because TRL's client drops each
choice's `finish_reason`: a segment cut by the server's length limit must not read as stopped.
Like the offline vLLM backend it decodes with causal attention only.
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
        from trl.generation.vllm_client import parse_logprobs

        if request.max_new_tokens <= 0:
            return SegmentResult([], [], False)
        payload = {"model": self.client.model, "prompt": [list(request.token_ids)], "n": 1,
                   "temperature": request.temperature, "top_p": request.top_p,
                   "max_tokens": request.max_new_tokens,
                   "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
                   "stop_token_ids": sorted(request.stop_ids), "seed": request.seed,
                   "skip_special_tokens": False}
        if request.banned_ids:
            payload["logit_bias"] = {str(t): BAN_BIAS for t in request.banned_ids}
        try:
            (choice,) = self.client._post(f"{self.client.base_url}/v1/completions", json=payload)["choices"]
            tokens = list(choice["token_ids"])
            all_values, all_ids = parse_logprobs([choice["logprobs"]])
            if all_values is None or all_ids is None:
                raise ValueError("the reply has no logprobs")
            (values,), (ids,) = all_values, all_ids
        except Exception as err:  # requests/HTTP errors arrive as bare Exceptions from VLLMClient
            raise PipelineError(f"vLLM server {self.client.base_url}: {str(err).splitlines()[0]}") from None
        logprobs = [row[row_ids.index(token)]
                    for row, row_ids, token in zip(values, ids, tokens, strict=True)]
        # "stop": a stop id or the model's EOS; "length": max_tokens or the server's max_model_len.
        return SegmentResult(tokens, logprobs, choice.get("finish_reason") == "stop")

    def continue_batch(self, requests: Sequence[SegmentRequest]) -> list[SegmentResult]:
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(requests))) as pool:
            return list(pool.map(self._one, requests))

    def sync_weights(self, model) -> None:
        """TRL's GRPOTrainer (vllm_mode="server") already pushes the weights before each rollout."""

    def close(self) -> None:
        self.client = None
