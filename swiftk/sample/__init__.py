"""Sampling in one home, as vLLM v1's ``sample/``: what the target chooses and whether a draft agrees with it.

- ``logits.py``: logits processing (temperature, top-k, top-p) and seeded draws, shared by target and draft;
- ``sampler.py``: a call's ``Sampler`` (greedy, coupled Gumbel-max, rejection) and its checked ``SamplingParams``;
  the coupled score is written once there and ranked by the draft side too;
- ``rejection.py``: the stateless rejection sampler over a verified tree (greedy walk, native twin
  ``swk_greedy_path``; multi-candidate speculative sampling), and the tree's parents-array checks.

Below the draft sources (``proposers/`` draws without replacement here) and the round (``decoding/``)."""
