//! Server identities, without I/O: an engine's signing key ([`IdentityKey`], Ed25519) and the
//! public half a client names when it expects a given server ([`ServerIdentity`]).
//!
//! A shared key proves only "holds this key": under per-peer keyrings every server that holds
//! a client's key answers that client's handshake, so an address that points at the wrong one
//! (a redirected record) is not noticed. A client that names the [`ServerIdentity`] it expects
//! sends [`ControlFrame::AuthHelloIdentified`](crate::wire::ControlFrame::AuthHelloIdentified);
//! the server answers with its challenge signed over the handshake's transcript (both fresh
//! nonces, both ids and epochs, the key name, its own public identity), which only the holder
//! of that signing key can produce (see [`crate::auth`]). The signing key never goes on the
//! wire and never appears in `Debug` output.

use std::fmt;
use std::str::FromStr;

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};

use crate::wire::{IDENTITY_LEN, SIGNATURE_LEN};

/// An engine's signing key: proves its [`ServerIdentity`] in handshakes. `Debug` shows only
/// the public half.
#[derive(Clone)]
pub struct IdentityKey(SigningKey);

impl IdentityKey {
    /// A fresh key (one per process, by default).
    pub fn generate() -> Self {
        Self(SigningKey::from_bytes(&rand::random()))
    }

    /// The key of the 32-byte secret seed `seed`.
    pub fn from_seed(seed: &[u8; 32]) -> Self {
        Self(SigningKey::from_bytes(seed))
    }

    /// Parses a key file's text: the 32-byte seed as 64 hex digits on one line; blank lines and
    /// lines starting with `#` are ignored. Errors never show the key's digits.
    pub fn parse(text: &str) -> Result<Self, IdentityError> {
        let mut lines = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'));
        let (Some(line), None) = (lines.next(), lines.next()) else {
            return Err(IdentityError::BadKey {
                reason: "expected one line of 64 hex digits (the key's 32-byte seed)".into(),
            });
        };
        let seed = unhex::<32>(line).ok_or_else(|| IdentityError::BadKey {
            reason: format!(
                "the key is not 64 hex digits (a line of {} characters)",
                line.len()
            ),
        })?;
        Ok(Self::from_seed(&seed))
    }

    /// The public half, which clients name.
    pub fn public(&self) -> ServerIdentity {
        ServerIdentity(self.0.verifying_key().to_bytes())
    }

    /// The seed as a key file holds it (64 hex digits): for writing one, never for logs.
    pub fn to_file_text(&self) -> String {
        hex(&self.0.to_bytes())
    }

    pub(crate) fn sign(&self, message: &[u8]) -> [u8; SIGNATURE_LEN] {
        self.0.sign(message).to_bytes()
    }
}

impl fmt::Debug for IdentityKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdentityKey(public {}, secret not shown)", self.public())
    }
}

/// A server's public identity: an Ed25519 public key, written as 64 hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ServerIdentity([u8; IDENTITY_LEN]);

impl ServerIdentity {
    /// The identity of these 32 bytes (checked when it verifies a signature).
    pub fn from_bytes(bytes: [u8; IDENTITY_LEN]) -> Self {
        Self(bytes)
    }

    /// Its bytes.
    pub fn to_bytes(self) -> [u8; IDENTITY_LEN] {
        self.0
    }

    /// Whether `signature` is this identity's over `message` (strict Ed25519: no malleable or
    /// small-order forms).
    pub(crate) fn verifies(&self, message: &[u8], signature: &[u8; SIGNATURE_LEN]) -> bool {
        let Ok(key) = VerifyingKey::from_bytes(&self.0) else {
            return false;
        };
        key.verify_strict(message, &Signature::from_bytes(signature))
            .is_ok()
    }
}

impl fmt::Display for ServerIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

impl fmt::Debug for ServerIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ServerIdentity({self})")
    }
}

impl FromStr for ServerIdentity {
    type Err = IdentityError;

    /// 64 hex digits (as [`Display`](fmt::Display) writes them), surrounding space ignored.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let bytes = unhex::<IDENTITY_LEN>(s).ok_or_else(|| IdentityError::BadIdentity {
            text: s.chars().take(80).collect(),
        })?;
        Ok(Self(bytes))
    }
}

/// Why an identity key or a public identity was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    /// A key file is not one line of 64 hex digits (its digits are never shown).
    #[error("identity key: {reason}")]
    BadKey {
        /// What is wrong.
        reason: String,
    },
    /// A public identity is not 64 hex digits.
    #[error("server identity {text:?} is not 64 hex digits (an Ed25519 public key)")]
    BadIdentity {
        /// The text given (at most 80 characters of it).
        text: String,
    },
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_round_trip_as_hex_and_keys_never_show_their_seed() {
        let key = IdentityKey::from_seed(&[7; 32]);
        let public = key.public();
        let text = public.to_string();
        assert_eq!(text.len(), 64);
        assert_eq!(text.parse::<ServerIdentity>().unwrap(), public);
        assert!(format!("{key:?}").contains(&text));
        assert!(!format!("{key:?}").contains(&"07".repeat(8)));
        let file = format!("# ferry identity\n{}\n", key.to_file_text());
        assert_eq!(IdentityKey::parse(&file).unwrap().public(), public);
        for bad in [
            "",
            "abc",
            &"zz".repeat(32),
            &format!("{0}\n{0}", "00".repeat(32)),
        ] {
            let e = IdentityKey::parse(bad).unwrap_err();
            assert!(!e.to_string().contains("zzzz"), "{e}");
        }
        assert!("00".parse::<ServerIdentity>().is_err());
        assert_ne!(
            IdentityKey::generate().public(),
            IdentityKey::generate().public()
        );
    }

    #[test]
    fn a_signature_verifies_only_for_its_identity_and_message() {
        let (a, b) = (
            IdentityKey::from_seed(&[1; 32]),
            IdentityKey::from_seed(&[2; 32]),
        );
        let sig = a.sign(b"transcript");
        assert!(a.public().verifies(b"transcript", &sig));
        assert!(!a.public().verifies(b"transcripT", &sig));
        assert!(!b.public().verifies(b"transcript", &sig));
        assert!(!ServerIdentity([0; 32]).verifies(b"transcript", &sig));
    }
}
