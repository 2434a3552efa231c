"""The membership authority: the coordinator that decides and publishes generations, restores
itself after a restart, gives lost nodes to standbys (`spare_pool`), writes `events.jsonl`
(`event_log`), and the process that serves the job's store and keeps it running (`store_host`)."""
