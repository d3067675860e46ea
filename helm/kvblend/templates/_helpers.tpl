{{/* Names ---------------------------------------------------------------------------- */}}

{{- define "kvblend.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* Kept to 40 characters: KubeRay derives pod and service names from the RayCluster name. */}}
{{- define "kvblend.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvblend.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvblend.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvblend.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvblend.labels" -}}
helm.sh/chart: {{ include "kvblend.chart" . }}
{{ include "kvblend.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvblend
{{- end -}}

{{/* Labels of one component: (dict "ctx" $ "component" "ray-head") */}}
{{- define "kvblend.componentLabels" -}}
{{ include "kvblend.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvblend.componentSelector" -}}
{{ include "kvblend.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvblend.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvblend.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvblend.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The chart's own ClusterIP Service in front of the Ray head's GCS (6379) and Ray Client
(10001) ports: what every Ray node of the release joins through. */}}
{{- define "kvblend.headService" -}}
{{- printf "%s-head" (include "kvblend.fullname" .) -}}
{{- end -}}

{{/* The Service in front of the Ray head's dashboard (8265) only; head.dashboardService.type. */}}
{{- define "kvblend.dashboardService" -}}
{{- printf "%s-dashboard" (include "kvblend.fullname" .) -}}
{{- end -}}

{{- define "kvblend.rayAddress" -}}
{{- printf "%s.%s.svc:6379" (include "kvblend.headService" .) .Release.Namespace -}}
{{- end -}}

{{- define "kvblend.rayTokenSecret" -}}
{{- default (printf "%s-ray-token" (include "kvblend.fullname" .)) .Values.rayAuth.existingSecret -}}
{{- end -}}

{{/* A Secret holding one random value, kept across upgrades (a new value would lock running
pods out or turn stored objects into misses) and left behind on uninstall.
Args: dict "ctx" . "name" <Secret name> "key" <data key> "component" <label> "length" <chars>. */}}
{{- define "kvblend.generatedSecret" -}}
{{- $old := lookup "v1" "Secret" .ctx.Release.Namespace .name }}
{{- $value := "" }}
{{- if and $old $old.data (index $old.data .key) }}
{{- $value = index $old.data .key | b64dec }}
{{- else }}
{{- $value = randAlphaNum .length }}
{{- end }}
apiVersion: v1
kind: Secret
metadata:
  name: {{ .name }}
  labels:
    {{- include "kvblend.componentLabels" (dict "ctx" .ctx "component" .component) | nindent 4 }}
  annotations:
    helm.sh/resource-policy: keep
type: Opaque
data:
  {{ .key }}: {{ $value | b64enc | quote }}
{{- end -}}

{{- define "kvblend.objectKeySecret" -}}
{{- .Values.objectAuth.existingSecret | default (printf "%s-object-key" (include "kvblend.fullname" .)) -}}
{{- end -}}

{{- define "kvblend.redisInternalName" -}}
{{- printf "%s-redis" (include "kvblend.fullname" .) -}}
{{- end -}}

{{/* Sizes --------------------------------------------------------------------------------
GiB (float) -> whole MiB, rounded up, as a Kubernetes quantity. */}}
{{- define "kvblend.gibToMi" -}}
{{- printf "%dMi" (mulf . 1024.0 | ceil | int64) -}}
{{- end -}}

{{/* A Ray object store size in GiB -> bytes (ray start takes bytes). Shard nodes use
kvblend.config.object_store_gib (their host tier lives in it); the head and vLLM nodes have
their own, smaller sizes. */}}
{{/* A vLLM pod's memory request and limit: vllm.memory plus the shared-memory arena of each
worker's cache agent (kvblend.config.agent_arena_gib per GPU worker: its pages are the pod's
memory once written). */}}
{{- define "kvblend.vllmMemory" -}}
{{- $v := .Values.vllm -}}
{{- $mem := toString $v.memory -}}
{{- if not (hasSuffix "Gi" $mem) -}}
{{- fail (printf "vllm.memory must be given in Gi (got %q): the chart adds the cache agent's arena to it" $mem) -}}
{{- end -}}
{{- $workers := max 1 (int $v.gpus) -}}
{{- $arena := mulf (float64 (default 0.0 .Values.kvblend.config.agent_arena_gib)) (float64 $workers) -}}
{{- include "kvblend.gibToMi" (addf (float64 (trimSuffix "Gi" $mem)) $arena) -}}
{{- end -}}

{{- define "kvblend.bytes" -}}
{{- printf "%d" (mulf . 1073741824.0 | floor | int64) -}}
{{- end -}}

{{/* /dev/shm of a Ray node with an object store of this many GiB: the object store lives
there; 10% + 256 MiB of slack. */}}
{{- define "kvblend.rayShmGiB" -}}
{{- addf (mulf . 1.1) 0.25 -}}
{{- end -}}

{{/* Shard pod memory: /dev/shm (the object store, which holds the host tier of every shard
on the node, see cluster/cli/server.py) + overhead (raylet, shard actor processes). */}}
{{- define "kvblend.shardMemoryGiB" -}}
{{- addf (include "kvblend.rayShmGiB" .Values.kvblend.config.object_store_gib | float64) .Values.shards.memoryOverheadGiB -}}
{{- end -}}

{{/* `kvblend server` refuses a host tier larger than the object store that holds it:
refuse the same values here, at install time, rather than in a crash-looping pod. */}}
{{- define "kvblend.checkSizes" -}}
{{- $c := .Values.kvblend.config -}}
{{- $host := mulf $c.host_size_gib $c.shards_per_node -}}
{{- if gt $host ($c.object_store_gib | float64) -}}
{{- fail (printf "kvblend.config: host_size_gib (%v) x shards_per_node (%v) = %v GiB exceeds object_store_gib (%v): the Ray object store of a shard node holds its host tier; raise object_store_gib or lower host_size_gib" $c.host_size_gib $c.shards_per_node $host $c.object_store_gib) -}}
{{- end -}}
{{- end -}}

{{/* Shard disk volume: the disk tier of every shard on the node + 10% for partial files. */}}
{{- define "kvblend.shardDiskGiB" -}}
{{- $c := .Values.kvblend.config -}}
{{- addf (mulf $c.disk_size_gib $c.shards_per_node 1.1) 1.0 -}}
{{- end -}}

{{- define "kvblend.headMemoryGiB" -}}
{{- addf (include "kvblend.rayShmGiB" .Values.head.objectStoreGiB | float64) .Values.head.memoryOverheadGiB -}}
{{- end -}}

{{/* Redis --------------------------------------------------------------------------------
redis_url as written to the ConfigMap: never with a password (that comes whole through
KVBLEND_REDIS_PASSWORD, a secretKeyRef variable). */}}
{{- define "kvblend.redisHostPortDb" -}}
{{- if eq .Values.redis.mode "internal" -}}
{{- printf "%s.%s.svc:6379/0" (include "kvblend.redisInternalName" .) .Release.Namespace -}}
{{- else if eq .Values.redis.mode "external" -}}
{{- printf "%s:%d/%d" .Values.redis.external.host (int .Values.redis.external.port) (int .Values.redis.external.db) -}}
{{- end -}}
{{- end -}}

{{- define "kvblend.redisScheme" -}}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.tls -}}rediss{{- else -}}redis{{- end -}}
{{- end -}}

{{- define "kvblend.redisUrl" -}}
{{- if ne .Values.redis.mode "none" -}}
{{- printf "%s://%s" (include "kvblend.redisScheme" .) (include "kvblend.redisHostPortDb" .) -}}
{{- end -}}
{{- end -}}

{{/* (secret name, key) of the Redis password, or empty. */}}
{{- define "kvblend.redisPasswordSecret" -}}
{{- if eq .Values.redis.mode "internal" -}}
{{- include "kvblend.redisInternalName" . -}}
{{- else if and (eq .Values.redis.mode "external") .Values.redis.external.passwordSecret.name -}}
{{- .Values.redis.external.passwordSecret.name -}}
{{- end -}}
{{- end -}}

{{- define "kvblend.redisPasswordKey" -}}
{{- if eq .Values.redis.mode "internal" -}}password{{- else -}}{{ .Values.redis.external.passwordSecret.key }}{{- end -}}
{{- end -}}

{{/* Redis TLS files (redis.external.tlsSecret): the Secret is mounted read-only at
kvblend.redisTlsDir in the pods that talk to Redis (vLLM, cache shards), and the
KVBLEND_REDIS_TLS_* variables name its files there. Files, not variables: a key never sits in
an environment or on a command line. "true" when on; refuses values that cannot work. */}}
{{- define "kvblend.redisTlsDir" -}}/etc/kvblend-redis-tls{{- end -}}

{{- define "kvblend.redisTlsOn" -}}
{{- $e := .Values.redis.external -}}
{{- if and (eq .Values.redis.mode "external") $e.tlsSecret.name -}}
{{- if not $e.tls -}}
{{- fail "redis.external.tlsSecret.name is set but redis.external.tls is false: set redis.external.tls=true (rediss://) or leave tlsSecret.name empty" -}}
{{- end -}}
{{- if and $e.tlsSecret.keyKey (not $e.tlsSecret.certKey) -}}
{{- fail "redis.external.tlsSecret.keyKey is set without certKey: a client key needs its certificate" -}}
{{- end -}}
{{- if not (or $e.tlsSecret.caKey $e.tlsSecret.certKey) -}}
{{- fail "redis.external.tlsSecret names no file: set caKey (the CA of the server's certificate) and/or certKey/keyKey (a client certificate)" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{- define "kvblend.redisTlsEnv" -}}
{{- if include "kvblend.redisTlsOn" . -}}
{{- $s := .Values.redis.external.tlsSecret -}}
{{- $dir := include "kvblend.redisTlsDir" . -}}
{{- range $var, $pair := dict "KVBLEND_REDIS_TLS_CA_FILE" (list $s.caKey "ca.crt") "KVBLEND_REDIS_TLS_CERT_FILE" (list $s.certKey "tls.crt") "KVBLEND_REDIS_TLS_KEY_FILE" (list $s.keyKey "tls.key") }}
{{- if index $pair 0 }}
- name: {{ $var }}
  value: {{ printf "%s/%s" $dir (index $pair 1) | quote }}
{{- end }}
{{- end }}
{{- end -}}
{{- end -}}

{{- define "kvblend.redisTlsVolumeMount" -}}
{{- if include "kvblend.redisTlsOn" . }}
- name: redis-tls
  mountPath: {{ include "kvblend.redisTlsDir" . }}
  readOnly: true
{{- end -}}
{{- end -}}

{{/* Owner root, group fsGroup (1000): readable by the kvblend user, by no one else. */}}
{{- define "kvblend.redisTlsVolume" -}}
{{- if include "kvblend.redisTlsOn" . -}}
{{- $s := .Values.redis.external.tlsSecret }}
- name: redis-tls
  secret:
    secretName: {{ $s.name }}
    defaultMode: 0440
    items:
      {{- range $pair := list (list $s.caKey "ca.crt") (list $s.certKey "tls.crt") (list $s.keyKey "tls.key") }}
      {{- if index $pair 0 }}
      - {key: {{ index $pair 0 | quote }}, path: {{ index $pair 1 }}}
      {{- end }}
      {{- end }}
{{- end -}}
{{- end -}}

{{- define "kvblend.s3Url" -}}
{{- if .Values.s3.enabled -}}
{{- if .Values.s3.prefix -}}
{{- printf "s3://%s/%s" .Values.s3.bucket .Values.s3.prefix -}}
{{- else -}}
{{- printf "s3://%s" .Values.s3.bucket -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Environment of every kvblend process: config file, Ray token, tier credentials.
Secrets only through secretKeyRef. */}}
{{- define "kvblend.env" -}}
- name: KVBLEND_CONFIG
  value: /etc/kvblend/kvblend.yaml
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: RAY_HEAD_ADDRESS
  value: {{ include "kvblend.rayAddress" . | quote }}
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
{{- if .Values.rayAuth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "kvblend.rayTokenSecret" . }}
      key: {{ .Values.rayAuth.secretKey }}
{{- end }}
{{- if .Values.objectAuth.enabled }}
{{- /* tiers.auth: every chunk object is signed and checked under this key */}}
- name: KVBLEND_OBJECT_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "kvblend.objectKeySecret" . }}
      key: {{ .Values.objectAuth.secretKey }}
{{- end }}
{{- $pwSecret := include "kvblend.redisPasswordSecret" . }}
{{- if $pwSecret }}
{{- /* the password whole (redis-py's password option, tiers.redis_url: any characters, none
percent-encoded); the ConfigMap's redis_url carries none (issue 37) */}}
- name: KVBLEND_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $pwSecret }}
      key: {{ include "kvblend.redisPasswordKey" . }}
{{- end }}
{{- if and .Values.s3.enabled .Values.s3.credentialsSecret.name }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ .Values.s3.credentialsSecret.name }}
      key: {{ .Values.s3.credentialsSecret.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.s3.credentialsSecret.name }}
      key: {{ .Values.s3.credentialsSecret.secretAccessKeyKey }}
{{- end }}
{{- end -}}

{{- define "kvblend.configVolumeMount" -}}
- name: kvblend-config
  mountPath: /etc/kvblend
  readOnly: true
{{- end -}}

{{- define "kvblend.configVolume" -}}
- name: kvblend-config
  configMap:
    name: {{ include "kvblend.fullname" . }}-config
{{- end -}}

{{/* A Memory-backed /dev/shm of the given size in GiB. */}}
{{- define "kvblend.shmVolume" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ include "kvblend.gibToMi" . }}
{{- end -}}

{{- define "kvblend.podSecurityContext" -}}
{{ toYaml .Values.podSecurityContext }}
{{- end -}}

{{- define "kvblend.containerSecurityContext" -}}
{{ toYaml .Values.containerSecurityContext }}
{{- end -}}

{{/* KubeRay prerequisite: fail a real install when the RayCluster API is missing.
Offline (`helm template`, `helm lint`) `lookup` returns nothing, so the check never runs
there; against a cluster the release namespace's default ServiceAccount always exists. */}}
{{- define "kvblend.requireKubeRay" -}}
{{- if .Values.kuberay.checkCRD -}}
{{- $live := lookup "v1" "ServiceAccount" .Release.Namespace "default" -}}
{{- if and $live (not (.Capabilities.APIVersions.Has "ray.io/v1/RayCluster")) -}}
{{- fail "kvblend needs the KubeRay operator (>= 1.1): this cluster has no ray.io/v1 RayCluster API (CRD rayclusters.ray.io). Install it first: `helm repo add kuberay https://ray-project.github.io/kuberay-helm/ && helm install kuberay-operator kuberay/kuberay-operator`, then install kvblend again. (Set kuberay.checkCRD=false to skip this check.)" -}}
{{- end -}}
{{- end -}}
{{- end -}}
