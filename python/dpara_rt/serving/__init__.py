"""Serving: continuous batching (``batching``, ``scheduler``), the OpenAI-compatible server (``server``), text in
and out (``text``), and the step-level speculator for engines that own their target (``speculator``)."""
