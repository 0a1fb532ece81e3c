//! A network of the suite's own, for the scenarios that cut, slow down and
//! drop packets between workers and their database server, without touching
//! the machine's own network.
//!
//! Two network namespaces and two veth pairs:
//!
//! ```text
//!  this namespace ── healthy link ──┐
//!   (10.231.k.1)                    ├── server namespace (10.231.k.2, 10.231.k.6)
//!  client namespace ── faulty link ─┘
//!   (10.231.k.5)
//! ```
//!
//! The server runs in the server namespace and listens on both links. Workers
//! started in the client namespace reach it over the faulty link only, which
//! the scenario cuts, slows and makes lossy with rules of the server
//! namespace's own firewall; the scenario itself and the healthy workers use
//! the healthy link. Each namespace has its own TCP settings, so the client
//! namespace gets the short retransmission and keepalive timeouts the
//! documentation tells worker hosts to set, and the machine's stay as they
//! are. It all goes when the value is dropped.
//!
//! Needs root, `ip` (iproute2), `iptables` and `tc`; where one is missing or
//! the kernel refuses, [`TestNetwork::new`] panics saying which.

use std::process::{Command, Stdio};

/// Links already taken on this machine are skipped: their names are the lock.
const MAX_NETWORKS: u32 = 64;

/// The namespaces and links of one scenario (see the module's documentation).
pub struct TestNetwork {
    index: u32,
    /// The namespace the server runs in.
    pub server_namespace: String,
    /// The namespace of the workers behind the faulty link.
    pub client_namespace: String,
    /// The server's address on the healthy link.
    pub healthy_address: String,
    /// The server's address on the faulty link.
    pub faulty_address: String,
}

impl TestNetwork {
    /// Makes the namespaces and links, with the TCP settings of
    /// `client_sysctls` (`name=value`) in the client namespace and of
    /// `server_sysctls` in the server's.
    pub fn new(client_sysctls: &[&str], server_sysctls: &[&str]) -> Self {
        let index = claim_an_index().unwrap_or_else(|error| {
            panic!(
                "cannot make a veth pair for the network scenarios (they need root and \
                 iproute2, `ip`): {error}"
            )
        });
        let network = TestNetwork {
            index,
            server_namespace: format!("dcnet{index}-server"),
            client_namespace: format!("dcnet{index}-client"),
            healthy_address: format!("10.231.{index}.2"),
            faulty_address: format!("10.231.{index}.6"),
        };
        let (server, client) = (&network.server_namespace, &network.client_namespace);
        let net = format!("10.231.{index}");
        let (healthy_host, healthy_server) = (format!("dcnet{index}h"), format!("dcnet{index}s"));
        let (faulty_client, faulty_server) = (format!("dcnet{index}c"), format!("dcnet{index}f"));
        for namespace in [server, client] {
            ip(&["netns", "add", namespace]);
            network.inside(namespace, &["ip", "link", "set", "lo", "up"]);
        }
        ip(&["link", "set", &healthy_server, "netns", server]);
        ip(&[
            "link",
            "add",
            &faulty_client,
            "type",
            "veth",
            "peer",
            "name",
            &faulty_server,
        ]);
        ip(&["link", "set", &faulty_client, "netns", client]);
        ip(&["link", "set", &faulty_server, "netns", server]);
        ip(&["addr", "add", &format!("{net}.1/30"), "dev", &healthy_host]);
        ip(&["link", "set", &healthy_host, "up"]);
        for (namespace, link, address) in [
            (server, &healthy_server, format!("{net}.2/30")),
            (server, &faulty_server, format!("{net}.6/30")),
            (client, &faulty_client, format!("{net}.5/30")),
        ] {
            network.inside(namespace, &["ip", "addr", "add", &address, "dev", link]);
            network.inside(namespace, &["ip", "link", "set", link, "up"]);
        }
        for (namespace, settings) in [(client, client_sysctls), (server, server_sysctls)] {
            for setting in settings {
                network.inside(namespace, &["sysctl", "-q", "-w", setting]);
            }
        }
        network
    }

    /// `command` run in `namespace`.
    pub fn command_in(namespace: &str, command: &Command) -> Command {
        let mut wrapped = Command::new("ip");
        wrapped
            .args(["netns", "exec", namespace])
            .arg(command.get_program())
            .args(command.get_args());
        if let Some(dir) = command.get_current_dir() {
            wrapped.current_dir(dir);
        }
        for (key, value) in command.get_envs() {
            match value {
                Some(value) => wrapped.env(key, value),
                None => wrapped.env_remove(key),
            };
        }
        wrapped
    }

    /// Drops every packet on the faulty link, both ways.
    pub fn cut(&self) {
        self.heal();
        let link = self.faulty_server_link();
        self.firewall(&["-A", "INPUT", "-i", &link, "-j", "DROP"]);
        self.firewall(&["-A", "OUTPUT", "-o", &link, "-j", "DROP"]);
    }

    /// Drops each packet on the faulty link, both ways, with `probability`.
    pub fn lose(&self, probability: f64) {
        self.heal();
        let link = self.faulty_server_link();
        let probability = probability.to_string();
        for rule in [["-A", "INPUT", "-i"], ["-A", "OUTPUT", "-o"]] {
            self.firewall(
                &[rule[0], rule[1], rule[2], &link]
                    .into_iter()
                    .chain([
                        "-m",
                        "statistic",
                        "--mode",
                        "random",
                        "--probability",
                        &probability,
                        "-j",
                        "DROP",
                    ])
                    .collect::<Vec<_>>(),
            );
        }
    }

    /// Sends the server's packets on the faulty link no faster than
    /// `kilobits` per second (a token bucket: the excess waits in a queue).
    pub fn slow(&self, kilobits: u32) {
        let link = self.faulty_server_link();
        let rate = format!("{kilobits}kbit");
        self.inside(
            &self.server_namespace,
            &[
                "tc", "qdisc", "replace", "dev", &link, "root", "tbf", "rate", &rate, "burst",
                "16kbit", "latency", "2s",
            ],
        );
    }

    /// Lifts every fault of the faulty link.
    pub fn heal(&self) {
        self.firewall(&["-F"]);
        let link = self.faulty_server_link();
        // Fails, harmlessly, when there is no queue to take away.
        let _ = run_status(&mut Self::command_in(
            &self.server_namespace,
            Command::new("tc").args(["qdisc", "del", "dev", &link, "root"]),
        ));
    }

    fn faulty_server_link(&self) -> String {
        format!("dcnet{}f", self.index)
    }

    fn firewall(&self, rule: &[&str]) {
        self.inside(&self.server_namespace, &[&["iptables"], rule].concat());
    }

    fn inside(&self, namespace: &str, command: &[&str]) {
        let (program, args) = command.split_first().expect("a command");
        let mut command = Command::new(program);
        command.args(args);
        let mut wrapped = Self::command_in(namespace, &command);
        if !run_status(&mut wrapped) {
            panic!(
                "the network scenarios could not run {command:?} in {namespace} (they need root, \
                 iproute2, iptables and tc, and a kernel with network namespaces, veth, \
                 iptables' statistic match and the tbf queue): {}",
                describe_failure(&mut wrapped)
            );
        }
    }
}

impl Drop for TestNetwork {
    fn drop(&mut self) {
        // Deleting a namespace deletes its links, and their peers with them.
        for namespace in [&self.client_namespace, &self.server_namespace] {
            let _ = run_status(Command::new("ip").args(["netns", "del", namespace]));
        }
        let _ =
            run_status(Command::new("ip").args(["link", "del", &format!("dcnet{}h", self.index)]));
    }
}

/// The first free network index: the one whose healthy link this call
/// could create (a link of that name already there means another network
/// has it). Any other failure is the error.
fn claim_an_index() -> Result<u32, String> {
    for index in 0..MAX_NETWORKS {
        let output = Command::new("ip")
            .args([
                "link",
                "add",
                &format!("dcnet{index}h"),
                "type",
                "veth",
                "peer",
                "name",
            ])
            .arg(format!("dcnet{index}s"))
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run ip: {e}"))?;
        if output.status.success() {
            return Ok(index);
        }
        let error = String::from_utf8_lossy(&output.stderr);
        if !error.contains("File exists") {
            return Err(format!("{}: {}", output.status, error.trim()));
        }
    }
    Err(format!("all {MAX_NETWORKS} networks are in use"))
}

fn ip(args: &[&str]) {
    let mut command = Command::new("ip");
    command.args(args);
    if !run_status(&mut command) {
        panic!(
            "the network scenarios could not run {command:?} (they need root and iproute2): {}",
            describe_failure(&mut command)
        );
    }
}

fn run_status(command: &mut Command) -> bool {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// Runs `command` again to say why it failed.
fn describe_failure(command: &mut Command) -> String {
    match command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
    {
        Ok(output) => format!(
            "{}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ),
        Err(error) => format!("cannot run it: {error}"),
    }
}
