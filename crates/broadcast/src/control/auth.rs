//! The challenge-response steps of one control connection, and every request before the proof.

use std::sync::Arc;

use ferry::core_types::auth::{PendingProof, ServerAuth, nonce};
use ferry::core_types::wire::{AuthProof, ControlFrame};
use ferry::{Epoch, PeerId};

use crate::manifest::Digest;

use super::messages::{Reply, Request};

/// A keyed member's side of the challenge-response: its server side, and the id and epoch it
/// answers as.
pub(crate) type MemberAuth = (ServerAuth, PeerId, Epoch);

/// Where a connection stands with the member's keys.
pub(crate) enum ConnAuth {
    /// Keyless member: everything is answered.
    Open,
    /// Keyed: nothing proven yet.
    Unproven,
    /// Keyed: challenge sent, proof awaited.
    Challenged(PendingProof),
    /// Keyed: the key of this name was proven.
    Proven(Arc<str>),
}

fn refused(message: String) -> (Reply, bool) {
    (Reply::Error { message }, true)
}

/// The challenge-response steps, and every request before the proof: `None` for a request
/// to answer as usual.
///
/// `keys` is the member's (`None`: a keyless member), `source_epoch` what a proof's answer
/// carries.
pub(crate) fn authenticate(
    req: &Request,
    conn: &mut ConnAuth,
    keys: Option<&MemberAuth>,
    source_epoch: u64,
) -> Option<(Reply, bool)> {
    let Some((server, id, epoch)) = keys else {
        return match req {
            Request::AuthHello { .. } | Request::AuthProof { .. } => Some(refused(
                "this member takes no key (it was started without one)".into(),
            )),
            _ => None,
        };
    };
    match (req, std::mem::replace(conn, ConnAuth::Unproven)) {
        (
            Request::AuthHello {
                name,
                peer_id,
                epoch: client_epoch,
                nonce: client_nonce,
            },
            ConnAuth::Unproven,
        ) => {
            let Ok(pid) = u128::from_str_radix(peer_id, 16) else {
                return Some(refused("auth_hello: the peer id is not hex".into()));
            };
            let hello = ferry::core_types::wire::AuthHello {
                name: name.clone(),
                peer_id: PeerId(pid),
                epoch: Epoch(*client_epoch),
                nonce: client_nonce.0,
            };
            match server.challenge(&hello, *id, *epoch, nonce()) {
                Ok((ControlFrame::AuthChallenge(c), pending)) => {
                    *conn = ConnAuth::Challenged(pending);
                    Some((
                        Reply::AuthChallenge {
                            peer_id: format!("{:032x}", c.peer_id.0),
                            epoch: c.epoch.0,
                            nonce: Digest(c.nonce),
                            mac: Digest(c.mac),
                        },
                        false,
                    ))
                }
                Ok(_) => Some(refused("authentication failed".into())),
                Err(r) => Some(refused(r.message)),
            }
        }
        (Request::AuthProof { mac }, ConnAuth::Challenged(pending)) => {
            match server.verify(pending, &AuthProof { mac: mac.0 }) {
                Ok(name) => {
                    tracing::debug!(key = %name, "control connection authenticated");
                    *conn = ConnAuth::Proven(name);
                    Some((Reply::Ok { source_epoch }, false))
                }
                Err(r) => Some(refused(r.message)),
            }
        }
        (Request::AuthHello { .. } | Request::AuthProof { .. }, _) => {
            Some(refused("authentication out of order".into()))
        }
        (_, ConnAuth::Proven(name)) => {
            *conn = ConnAuth::Proven(name);
            None
        }
        (_, _) => Some(refused(
            "unauthenticated: this broadcast is keyed; requests need its key \
             (--auth-key-file, FERRY_AUTH_KEY_FILE)"
                .into(),
        )),
    }
}
