"""The generic round, the same on every device: the values a round hands between lanes (``values``), the
``Decoder`` that runs a round's steps (``decoder``), the chain of lane jobs (``chain``), the lanes (``lanes``), a
call's options (``options``) and its statistics (``stats``); ``reference`` is the plain-torch round the tests use
as an oracle. Drafting goes through ``dpara_rt.drafting``'s backend interface; nothing here imports the CPU
host's machinery (``dpara_rt.host``)."""
