"""Machinery that exists only for CPU hosts (see README.md beside this file): the drafting backend that runs
the drafter in a worker process, the native target and its packed projections, the native Markov head and
verification. The generic round (``dpara_rt.round``, ``dpara_rt.methods``, ``dpara_rt.drafting``) never imports
it; the engine picks it for a CPU drafter (``Engine(drafting=...)``)."""
