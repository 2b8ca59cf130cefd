//! The agent's side of cluster membership: registering
//! with the control plane, heartbeating, routing peers' subnets and fencing
//! jails whose placement moved away.
//!
//! A thread of its own ([`membership::spawn`]) talks to the control plane, so
//! a slow or unreachable control plane never delays an API request: it
//! registers (retrying with backoff, 1 s doubling to 30 s, while the agent
//! serves locally), then heartbeats every `agent.heartbeat_interval`, and
//! at once when a placed jail's readiness flips or its process starts or
//! exits. A second thread ([`watch`]) long-polls the control plane for the
//! endpoint table and gives each newer one to the proxy directly, so a
//! readiness change elsewhere reaches this node's proxy in well under a
//! second instead of up to two heartbeat periods.
//!
//! Nothing slow stands in front of liveness, in either direction. A heartbeat
//! is built from the jail statuses the worker last published
//! ([`crate::agentd::worker::WorkerHandle::published_jails`]), never by a
//! command to the worker, so a `jail -c` or `zfs` call that takes 30 s does
//! not delay it past the control plane's `dead_after`. And the thread never
//! waits for an answer to be applied: it hands the answer (and, after
//! registering, the subnet to adopt) to the [`applier::Applier`], whose own
//! thread sends it to the worker (adopting the node subnet,
//! [`crate::agentd::worker::Command::AdoptSubnet`], or applying the answer,
//! [`crate::agentd::worker::Command::ClusterUpdate`], which runs
//! [`crate::agentd::routes::apply_heartbeat`] on the worker thread) and then, once the
//! worker has aliased the answer's VIPs on the bridge, gives the answer's
//! service table to the node's service proxy
//! ([`Proxy::update`](crate::agentd::proxy::Proxy::update)). While the
//! worker is busy, newer answers replace the one waiting; only the newest is
//! applied, and the applier's docs say why a late one is still safe to fence
//! by.
//!
//! Rules this module keeps:
//! - A heartbeat that fails changes nothing: the node keeps its jails, its
//!   subnet and its routes until the control plane answers again. A 404 (the
//!   control plane forgot the node) re-registers.
//! - Only routes to peers' subnets are touched, and only VIP aliases Keel
//!   added are removed ([`crate::agentd::routes`]). When the control plane is unreachable the
//!   proxy keeps its last table.
//! - Fencing deletes only jails the control plane placed: a stale name is
//!   deleted when the jail still carries the epoch the agent reported in that
//!   heartbeat ([`heartbeat::stale_placed`]). A jail applied over the Unix
//!   socket has no epoch and is never deleted here, whatever the control
//!   plane says.
//!
//! Every request to the control plane is signed with the node key
//! (`agent.key_file`), and the agent's TCP listener answers only requests
//! signed with a node key from `auth.node_keys` ([`signed::SignedApi`]); the
//! Unix socket stays unauthenticated (its mode and group guard it). Both key
//! sets are read once at startup ([`signed::load_keys`]): rotating a node key
//! means restarting the agents, which never stops a jail.
//!
//! | file | owns |
//! |---|---|
//! | [`membership`] | the cluster thread and its control-plane client |
//! | [`applier`] | handing answers to the worker and the proxy, newest first, never waiting |
//! | [`watch`] | the endpoint watcher (long poll), and the table both paths hand the proxy |
//! | [`heartbeat`] | the heartbeat body, the held peer list, the fence list (pure) |
//! | [`identity`] | the node id and the host's capacity, decided at startup |
//! | [`signed`] | the signing keys and the guard on the agent's TCP listener |
//! | [`error`] | [`error::ClusterError`] |
//!
//! What the worker does with an answer (subnet, peer routes, VIP aliases,
//! fencing) is [`crate::agentd::routes`], outside this folder, so imports run
//! one way: the worker never imports this module; [`membership`] and
//! [`applier`] use the worker, [`heartbeat`] knows nothing of either, and
//! [`signed`] wraps the API. It never imports `controlplane`: the bodies are
//! `common::wire`.

pub mod applier;
pub mod error;
pub mod heartbeat;
pub mod identity;
pub mod membership;
pub mod signed;
pub mod watch;
