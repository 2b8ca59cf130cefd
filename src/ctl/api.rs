//! The agent's jail API (DESIGN.md section 5) as keelctl calls it: one method
//! per route, JSON answers decoded into [`crate::common::wire`] types, error
//! bodies into [`ErrorBody`].
//!
//! This file owns request paths and the decoding of answers. It never prints,
//! never reads specs from disk and never decides an exit status; it must never
//! import `host` or `agentd` (everything the agent says is in `common::wire`).

use std::fmt;

use serde::de::DeserializeOwned;

use crate::common::http::{Client, ClientResponse, Endpoint, HttpError};
use crate::common::spec::Jail;
use crate::common::wire::{ErrorBody, JailStatus};

/// Why a call to the agent did not succeed.
#[derive(Debug)]
pub enum ApiError {
    /// The request did not get an answer (cannot connect, timeout, broken
    /// response framing).
    Http(HttpError),
    /// The daemon answered with an error status.
    Refused {
        /// Who answered.
        endpoint: String,
        /// The status code.
        status: u16,
        /// Its error body (or, if it sent none, its body as text).
        body: ErrorBody,
    },
    /// The daemon answered success with a body keelctl cannot decode.
    BadResponse {
        /// Who answered.
        endpoint: String,
        /// The status code.
        status: u16,
        /// What was wrong with the body.
        reason: String,
    },
}

impl ApiError {
    /// The second line of the message: who answered what, and the field.
    pub fn detail(&self) -> Option<String> {
        match self {
            ApiError::Refused {
                endpoint,
                status,
                body,
            } => Some(match &body.field {
                Some(field) => format!("field {field}; {endpoint} answered HTTP {status}"),
                None => format!("{endpoint} answered HTTP {status}"),
            }),
            _ => None,
        }
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApiError::Http(e) => write!(f, "{e}"),
            ApiError::Refused { body, .. } => f.write_str(&body.error),
            ApiError::BadResponse {
                endpoint,
                status,
                reason,
            } => write!(
                f,
                "{endpoint} answered HTTP {status} with a body keelctl cannot read ({reason}); \
                 are keelctl and the daemon the same version?"
            ),
        }
    }
}

impl std::error::Error for ApiError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ApiError::Http(e) => Some(e),
            _ => None,
        }
    }
}

/// A client of one agent's jail routes.
#[derive(Debug, Clone)]
pub struct Api {
    client: Client,
}

impl Api {
    /// Talks to the daemon at `endpoint`.
    pub fn new(endpoint: Endpoint) -> Api {
        Api {
            client: Client::new(endpoint),
        }
    }

    /// `PUT /jails/{name}` with the jail as YAML; the agent reconciles it
    /// before answering with its status.
    pub fn apply_jail(&self, jail: &Jail) -> Result<JailStatus, ApiError> {
        let path = jail_path(&jail.metadata.name);
        let headers = [("Content-Type".to_string(), "application/yaml".to_string())];
        let body = jail.to_yaml();
        decode(
            self.call("PUT", &path, &headers, body.as_bytes())?,
            &self.client,
        )
    }

    /// `GET /jails`.
    pub fn list_jails(&self) -> Result<Vec<JailStatus>, ApiError> {
        decode(self.call("GET", "/jails", &[], b"")?, &self.client)
    }

    /// `GET /jails/{name}`; an unknown name is the agent's 404.
    pub fn get_jail(&self, name: &str) -> Result<JailStatus, ApiError> {
        decode(self.call("GET", &jail_path(name), &[], b"")?, &self.client)
    }

    /// `DELETE /jails/{name}`; returns once the agent has removed it.
    pub fn delete_jail(&self, name: &str) -> Result<(), ApiError> {
        self.call("DELETE", &jail_path(name), &[], b"").map(drop)
    }

    /// Sends one request; any status outside 2xx becomes [`ApiError::Refused`].
    fn call(
        &self,
        method: &str,
        path: &str,
        headers: &[(String, String)],
        body: &[u8],
    ) -> Result<ClientResponse, ApiError> {
        let response = self
            .client
            .request(method, path, headers, body)
            .map_err(ApiError::Http)?;
        if (200..300).contains(&response.status) {
            return Ok(response);
        }
        Err(ApiError::Refused {
            endpoint: self.client.endpoint.to_string(),
            status: response.status,
            body: error_body(&response.body),
        })
    }
}

/// Names reaching here are DNS labels (checked when parsed), so they need no
/// escaping in a path.
fn jail_path(name: &str) -> String {
    format!("/jails/{name}")
}

/// The error body of a refusal. A body that is not Keel's JSON shape (a
/// proxy's HTML page, a future daemon's format) is shown as text rather than
/// lost.
fn error_body(body: &[u8]) -> ErrorBody {
    serde_json::from_slice(body).unwrap_or_else(|_| {
        let text = super::output::one_line(&String::from_utf8_lossy(body));
        ErrorBody {
            error: if text.is_empty() {
                "(no error message)".into()
            } else {
                text
            },
            field: None,
        }
    })
}

fn decode<T: DeserializeOwned>(response: ClientResponse, client: &Client) -> Result<T, ApiError> {
    serde_json::from_slice(&response.body).map_err(|e| ApiError::BadResponse {
        endpoint: client.endpoint.to_string(),
        status: response.status,
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keel_error_bodies_keep_message_and_field() {
        let body = error_body(br#"{"error":"address taken","field":"spec.network.address"}"#);
        assert_eq!(body.error, "address taken");
        assert_eq!(body.field.as_deref(), Some("spec.network.address"));
        let refused = ApiError::Refused {
            endpoint: "/s.sock".into(),
            status: 409,
            body,
        };
        assert_eq!(refused.to_string(), "address taken");
        assert_eq!(
            refused.detail().as_deref(),
            Some("field spec.network.address; /s.sock answered HTTP 409")
        );
    }

    #[test]
    fn foreign_error_bodies_are_shown_as_one_line_of_text() {
        assert_eq!(
            error_body(b"<h1>Bad\nGateway</h1>\n").error,
            "<h1>Bad Gateway</h1>"
        );
        assert_eq!(error_body(b"").error, "(no error message)");
    }
}
