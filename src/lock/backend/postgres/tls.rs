//! TLS for the PostgreSQL backend, through rustls (with the ring provider, which builds without
//! cmake).
//!
//! The client library parses only `sslmode=disable|prefer|require`, and refuses options it does
//! not know, so the TLS settings of libpq's connection strings are taken out of the string here
//! before it is parsed: `sslmode` (also `verify-full`) and `sslrootcert`.
//!
//! | `sslmode` | encrypted | server certificate checked |
//! |---|---|---|
//! | `disable` | no | - |
//! | `prefer` (libpq's default) | if the server offers it | no |
//! | `require` | yes | no (as libpq), unless `sslrootcert` names a CA: then as `verify-full` |
//! | `verify-full` | yes | against `sslrootcert`, or the system's roots; and its host name |
//!
//! `verify-ca` (the chain without the host name) is refused with a clear error rather than
//! quietly checked more or less than asked.

use std::path::PathBuf;
use std::sync::Arc;

use postgres::config::SslMode;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::lock::LockError;

/// What a connection string asks of TLS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TlsSettings {
    pub(crate) mode: Mode,
    pub(crate) root_cert: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    Disable,
    Prefer,
    Require,
    VerifyFull,
}

fn invalid(why: String) -> LockError {
    LockError::InvalidConfig(format!("the PostgreSQL connection string: {why}"))
}

/// Splits the TLS settings out of a libpq connection string or URL; returns what is left, for
/// the client library to parse, and the settings.
pub(crate) fn split(url: &str) -> Result<(String, TlsSettings), LockError> {
    let mut settings = TlsSettings {
        mode: Mode::Prefer,
        root_cert: None,
    };
    let mut take = |key: &str, value: String| -> Result<bool, LockError> {
        match key {
            "sslmode" => {
                settings.mode = match value.as_str() {
                    "disable" => Mode::Disable,
                    "allow" | "prefer" => Mode::Prefer,
                    "require" => Mode::Require,
                    "verify-full" => Mode::VerifyFull,
                    "verify-ca" => {
                        return Err(invalid(
                            "sslmode=verify-ca is not supported; use verify-full, which also \
                             checks the host name"
                                .into(),
                        ))
                    }
                    other => return Err(invalid(format!("unknown sslmode {other:?}"))),
                };
                Ok(true)
            }
            "sslrootcert" => {
                settings.root_cert = Some(PathBuf::from(value));
                Ok(true)
            }
            _ => Ok(false),
        }
    };
    let rest = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        match url.split_once('?') {
            None => url.to_owned(),
            Some((base, query)) => {
                let mut kept = Vec::new();
                for pair in query.split('&').filter(|pair| !pair.is_empty()) {
                    let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                    if !take(key, percent_decode(value)?)? {
                        kept.push(pair);
                    }
                }
                if kept.is_empty() {
                    base.to_owned()
                } else {
                    format!("{base}?{}", kept.join("&"))
                }
            }
        }
    } else {
        let mut kept = Vec::new();
        for (key, value, text) in key_values(url)? {
            if !take(key, value)? {
                kept.push(text);
            }
        }
        kept.join(" ")
    };
    Ok((rest, settings))
}

/// `%XX` escapes of a URL's query value, decoded.
fn percent_decode(value: &str) -> Result<String, LockError> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = value
                    .get(i + 1..i + 3)
                    .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                    .ok_or_else(|| invalid("a bad %-escape in a parameter".into()))?;
                out.push(hex);
                i += 3;
            }
            byte => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| invalid("a parameter that is not UTF-8".into()))
}

/// The `key=value` pairs of a libpq key-value string: each key, its value (unquoted), and its
/// text as written (to pass on unchanged).
fn key_values(text: &str) -> Result<Vec<(&str, String, &str)>, LockError> {
    let mut pairs = Vec::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        let start = rest;
        let equals = rest
            .find('=')
            .ok_or_else(|| invalid("a key without a value".into()))?;
        let key = rest[..equals].trim();
        rest = rest[equals + 1..].trim_start();
        let mut value = String::new();
        if let Some(quoted) = rest.strip_prefix('\'') {
            let mut chars = quoted.char_indices();
            let mut end = None;
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, escaped)) = chars.next() {
                            value.push(escaped);
                        }
                    }
                    '\'' => {
                        end = Some(i + 1);
                        break;
                    }
                    c => value.push(c),
                }
            }
            let end = end.ok_or_else(|| invalid("an unterminated quoted value".into()))?;
            rest = &quoted[end..];
        } else {
            let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
            value.push_str(&rest[..end]);
            rest = &rest[end..];
        }
        let written = &start[..start.len() - rest.len()];
        pairs.push((key, value, written.trim()));
        rest = rest.trim_start();
    }
    Ok(pairs)
}

/// The client library's mode, and the connector (none for `disable`).
pub(crate) fn connector(
    settings: &TlsSettings,
) -> Result<(SslMode, Option<MakeRustlsConnect>), LockError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(format!("TLS set-up: {e}")))?;
    let verify = settings.mode == Mode::VerifyFull
        || (settings.mode == Mode::Require && settings.root_cert.is_some());
    let config = match settings.mode {
        Mode::Disable => return Ok((SslMode::Disable, None)),
        _ if verify => builder
            .with_root_certificates(roots(settings)?)
            .with_no_client_auth(),
        _ => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unverified(provider)))
            .with_no_client_auth(),
    };
    let mode = match settings.mode {
        Mode::Prefer => SslMode::Prefer,
        _ => SslMode::Require,
    };
    Ok((mode, Some(MakeRustlsConnect::new(config))))
}

/// The CA certificates of `sslrootcert`, or the system's.
fn roots(settings: &TlsSettings) -> Result<RootCertStore, LockError> {
    let mut roots = RootCertStore::empty();
    match &settings.root_cert {
        Some(path) => {
            let certificates = CertificateDer::pem_file_iter(path)
                .and_then(|certificates| certificates.collect::<Result<Vec<_>, _>>())
                .map_err(|e| invalid(format!("sslrootcert {}: {e}", path.display())))?;
            let (added, _) = roots.add_parsable_certificates(certificates);
            if added == 0 {
                return Err(invalid(format!(
                    "sslrootcert {} holds no usable certificate",
                    path.display()
                )));
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
            if roots.is_empty() {
                return Err(invalid(
                    "sslmode=verify-full needs a CA: no system roots were found; name one with \
                     sslrootcert"
                        .into(),
                ));
            }
        }
    }
    Ok(roots)
}

/// `sslmode=prefer` and `require` as libpq has them: encrypted, the certificate not checked
/// (the handshake's signatures still are).
#[derive(Debug)]
struct Unverified(Arc<CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_settings_are_taken_out_of_urls_and_key_value_strings() {
        let (rest, settings) =
            split("postgres://u:p@h/db?sslmode=verify-full&sslrootcert=%2Ftmp%2Fca.pem&x=1")
                .unwrap();
        assert_eq!(rest, "postgres://u:p@h/db?x=1");
        assert_eq!(settings.mode, Mode::VerifyFull);
        assert_eq!(settings.root_cert, Some(PathBuf::from("/tmp/ca.pem")));

        let (rest, settings) = split("postgres://h/db?sslmode=require").unwrap();
        assert_eq!(
            (rest.as_str(), settings.mode),
            ("postgres://h/db", Mode::Require)
        );

        let (rest, settings) =
            split("host=/run/pg user='a b' sslmode=disable sslrootcert='/x y/ca.pem' dbname=d")
                .unwrap();
        assert_eq!(rest, "host=/run/pg user='a b' dbname=d");
        assert_eq!(settings.mode, Mode::Disable);
        assert_eq!(settings.root_cert, Some(PathBuf::from("/x y/ca.pem")));

        assert_eq!(split("host=h").unwrap().1.mode, Mode::Prefer);
        assert!(split("host=h sslmode=verify-ca").is_err());
        assert!(split("host=h sslmode=sometimes").is_err());
        assert!(split("host='h").is_err());
    }
}
