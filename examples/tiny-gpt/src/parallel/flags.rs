//! The topology's flags checked before any training: counts, ranks, `HOST:PORT` addresses, and
//! the ports this node would listen on.

use std::net::{TcpListener, ToSocketAddrs};

use super::error::ParallelError;
use super::topology::Topology;

impl Topology {
    /// The orchestrator's and this node's data service's addresses, required with several nodes.
    pub(super) fn addresses(&self) -> Result<(&str, &str), ParallelError> {
        let missing = |flag| ParallelError::Flag {
            flag,
            reason: "required with --nodes above 1",
        };
        Ok((
            self.orchestrator
                .as_deref()
                .ok_or_else(|| missing("--orchestrator"))?,
            self.data_address
                .as_deref()
                .ok_or_else(|| missing("--data-address"))?,
        ))
    }

    /// Checks the flags, and that the ports this node listens on are free, before any training.
    pub fn validate(&self, batch: usize) -> Result<(), ParallelError> {
        let setting = |flag, value: String, reason: String| ParallelError::Setting {
            flag,
            value,
            reason,
        };
        for (flag, value) in [("--peers", self.peers), ("--nodes", self.nodes)] {
            if value == 0 {
                return Err(setting(flag, "0".into(), "must be at least 1".into()));
            }
        }
        if !batch.is_multiple_of(self.replicas()) {
            return Err(setting(
                "--batch",
                batch.to_string(),
                format!(
                    "must be divisible by the {} replicas (--peers {} × --nodes {})",
                    self.replicas(),
                    self.peers,
                    self.nodes
                ),
            ));
        }
        if self.nodes == 1 {
            let stray = [
                ("--orchestrator", self.orchestrator.is_some()),
                ("--data-address", self.data_address.is_some()),
                ("--node-rank", self.rank != 0),
            ];
            if let Some((flag, _)) = stray.into_iter().find(|(_, given)| *given) {
                return Err(ParallelError::Flag {
                    flag,
                    reason: "only with --nodes above 1",
                });
            }
            return Ok(());
        }
        if self.rank >= self.nodes {
            return Err(setting(
                "--node-rank",
                self.rank.to_string(),
                format!("must be below --nodes {}", self.nodes),
            ));
        }
        let (orchestrator, data_address) = self.addresses()?;
        for (flag, address) in [
            ("--orchestrator", orchestrator),
            ("--data-address", data_address),
        ] {
            if address.contains("://") || address.to_socket_addrs().is_err() {
                return Err(setting(
                    flag,
                    address.into(),
                    "must be HOST:PORT, a host this machine can resolve".into(),
                ));
            }
        }
        port_free("data service", port_of("--data-address", data_address)?)?;
        if self.rank == 0 && !self.external_orchestrator {
            port_free("orchestrator", port_of("--orchestrator", orchestrator)?)?;
        }
        Ok(())
    }
}

/// Refuses a port taken by another program: the orchestrator and the data service would only log
/// it and leave the peers waiting.
pub fn port_free(what: &'static str, port: u16) -> Result<(), ParallelError> {
    TcpListener::bind(("0.0.0.0", port))
        .map(drop)
        .map_err(|source| ParallelError::PortInUse { what, port, source })
}

/// The port at the end of `flag`'s `HOST:PORT` value.
pub(super) fn port_of(flag: &'static str, address: &str) -> Result<u16, ParallelError> {
    address
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .ok_or_else(|| ParallelError::Setting {
            flag,
            value: address.into(),
            reason: "must end in :PORT".into(),
        })
}
