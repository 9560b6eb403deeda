"""elastic: the etcd v3 rendezvous for torchrun, node leases, and `relight run`.

The public surface, by module (imported directly; this package imports nothing, so
`import relight.elastic.etcd_server` stays light):

- `elastic.etcd_client`: `EtcdClient`, `EtcdSettings`, `LeaseKeeper`, `EtcdError`,
  `EtcdUnavailableError`, `EtcdAuthError`, `EtcdLeaseLostError` (docs/design/etcd-client.md);
- `elastic.rendezvous`: `EtcdRendezvousHandler`, `RendezvousSettings`, `create_handler`,
  `torchrun_handler` (torchrun backend `relight-etcd`; docs/elastic.md);
- `elastic.launch`: `main(argv) -> int`, the `relight run` command;
- `elastic.agent`: `RelightAgent`, torchrun's agent retrying a round whose store host
  died during rank assignment and not counting preemptions against `--max-restarts`
  (installed by `relight run`);
- `elastic.etcd_server`: `EtcdServer`, `EtcdTLS`, a real etcd child process.
"""

__all__ = ["agent", "etcd_client", "etcd_server", "launch", "rendezvous"]
