"""`agentrl view`: a web app over run folders' metrics and rollout records (``agentrl.runs``), and
`agentrl show`'s terminal rendering of the same records."""
