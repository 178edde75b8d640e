//! The admin API of tenants and keys (`/v1/tenants`, `/v1/keys`), with the `admin`
//! feature (it brings `dsec-iam`'s types).

use dsec_iam::api::{CreateKey, CreateTenant, UpdateTenant};
use dsec_iam::{KeyInfo, NewKey, Tenant, Usage};
use reqwest::Method;

use crate::{Client, ClientError};

impl Client {
    /// `GET /v1/tenants` (cluster admin).
    pub async fn list_tenants(&self) -> Result<Vec<Tenant>, ClientError> {
        Self::json(self.get(&["tenants"])).await
    }

    /// `POST /v1/tenants` (cluster admin).
    pub async fn create_tenant(&self, req: &CreateTenant) -> Result<Tenant, ClientError> {
        Self::json(self.post(&["tenants"], req)).await
    }

    /// `GET /v1/tenants/{tenant}`.
    pub async fn get_tenant(&self, tenant: &str) -> Result<Tenant, ClientError> {
        Self::json(self.get(&["tenants", tenant])).await
    }

    /// `PATCH /v1/tenants/{tenant}` (cluster admin): quotas and/or disabled, in one write.
    pub async fn update_tenant(
        &self,
        tenant: &str,
        req: &UpdateTenant,
    ) -> Result<Tenant, ClientError> {
        Self::json(self.request(Method::PATCH, &["tenants", tenant]).json(req)).await
    }

    /// `GET /v1/tenants/{tenant}/usage`.
    pub async fn tenant_usage(&self, tenant: &str) -> Result<Usage, ClientError> {
        Self::json(self.get(&["tenants", tenant, "usage"])).await
    }

    /// `GET /v1/tenants/{tenant}/keys`: without secrets.
    pub async fn list_keys(&self, tenant: &str) -> Result<Vec<KeyInfo>, ClientError> {
        Self::json(self.get(&["tenants", tenant, "keys"])).await
    }

    /// `POST /v1/tenants/{tenant}/keys`: the new key, whose secret is shown only now.
    pub async fn create_key(&self, tenant: &str, req: &CreateKey) -> Result<NewKey, ClientError> {
        Self::json(self.post(&["tenants", tenant, "keys"], req)).await
    }

    /// `GET /v1/keys/{key_id}`.
    pub async fn get_key(&self, key_id: &str) -> Result<KeyInfo, ClientError> {
        Self::json(self.get(&["keys", key_id])).await
    }

    /// `DELETE /v1/keys/{key_id}`: revokes it now.
    pub async fn revoke_key(&self, key_id: &str) -> Result<KeyInfo, ClientError> {
        Self::json(self.delete(&["keys", key_id])).await
    }

    /// `POST /v1/keys/{key_id}/rotate?grace_s=N`: a new key; the old one stops after
    /// `grace_s` seconds.
    pub async fn rotate_key(&self, key_id: &str, grace_s: u64) -> Result<NewKey, ClientError> {
        let rb = self
            .request(Method::POST, &["keys", key_id, "rotate"])
            .query(&[("grace_s", grace_s)]);
        Self::json(rb).await
    }
}
