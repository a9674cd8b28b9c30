"""``shardwise demo``: the failure shardwise exists to prevent, and a sharded GPT trained.

The top layer, beside the command line: ``main`` runs the demo over local CPU ranks;
``video_tokenizer`` is its frozen BatchNorm3d model (used by ``examples/`` too).
"""
