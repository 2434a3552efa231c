"""The node agent (`mecefo-launch`): the agent loop (`agent`), its command line and process start
(`agent_cli`), when a dead rank is restarted (`restart_policy`) and the node's snapshot process
(`snapshot_process`)."""
