{{/* Names and labels. */}}
{{- define "kvpool.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvpool.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvpool.daemonSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: daemon
{{- end -}}

{{- define "kvpool.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/*
The daemon's kvpool.toml from a map: scalars and lists first, then one [table] per map
value (recursively). Helm reads YAML numbers as floats, so whole numbers are written as
integers (the daemon's schema takes an integer where it wants a float, never the other
way); strings are JSON-quoted (a TOML basic string); null values are left out (the
daemon's default). Called with (dict "prefix" "" "table" MAP).
*/}}
{{- define "kvpool.toml" -}}
{{- $prefix := .prefix -}}
{{- range $key, $value := .table }}
{{- if and (not (kindIs "map" $value)) (not (kindIs "invalid" $value)) }}
{{ include "kvpool.tomlKey" $key }} = {{ include "kvpool.tomlValue" $value }}
{{- end }}
{{- end }}
{{- range $key, $value := .table }}
{{- if kindIs "map" $value }}
{{- $path := printf "%s%s" $prefix (include "kvpool.tomlKey" $key) }}

[{{ $path }}]
{{- include "kvpool.toml" (dict "prefix" (printf "%s." $path) "table" $value) }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "kvpool.tomlKey" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . -}}{{ . }}{{- else -}}{{ toJson . }}{{- end -}}
{{- end -}}

{{- define "kvpool.tomlValue" -}}
{{- if kindIs "slice" . -}}
[{{ range $i, $v := . }}{{ if $i }}, {{ end }}{{ include "kvpool.tomlValue" $v }}{{ end }}]
{{- else if kindIs "bool" . -}}
{{ . }}
{{- else if or (kindIs "float64" .) (kindIs "int" .) (kindIs "int64" .) -}}
{{- if eq (float64 (int64 .)) (float64 .) -}}{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- else -}}
{{ toJson (toString .) }}
{{- end -}}
{{- end -}}

{{/* The daemon's configuration: .Values.config with run_dir and the metrics address. */}}
{{- define "kvpool.config" -}}
{{- $cfg := deepCopy .Values.config -}}
{{- if and (hasKey $cfg "run_dir") (ne (toString (get $cfg "run_dir")) (toString .Values.runDir)) (not (kindIs "invalid" (get $cfg "run_dir"))) -}}
{{- fail (printf "config.run_dir (%v) differs from runDir (%v): set runDir alone" (get $cfg "run_dir") .Values.runDir) -}}
{{- end -}}
{{- if and (hasKey $cfg "metrics_address") (not (kindIs "invalid" (get $cfg "metrics_address"))) -}}
{{- fail "config.metrics_address: set metrics.enabled and metrics.port instead" -}}
{{- end -}}
{{- $_ := set $cfg "run_dir" .Values.runDir -}}
{{- if .Values.metrics.enabled -}}
{{- $_ := set $cfg "metrics_address" (printf "0.0.0.0:%v" (int .Values.metrics.port)) -}}
{{- $_ := set $cfg "metrics_allow_remote" true -}}
{{- end -}}
{{- include "kvpool.toml" (dict "prefix" "" "table" $cfg) -}}
{{- end -}}

{{/*
What every tenant pod needs to reach the node's daemon: the run directory at the same
path (read-only: a client connects to the sockets and writes nothing there), the socket
group, and the daemon's uid as one it may trust (KVPOOL_DAEMON_UID).
*/}}
{{- define "kvpool.tenantEnv" -}}
- name: KVPOOL_RUN_DIR
  value: {{ .Values.runDir | quote }}
- name: KVPOOL_DAEMON_UID
  value: {{ .Values.daemon.runAsRoot | ternary 0 .Values.daemon.uid | int | quote }}
- name: KVPOOL_DEVICE
  value: {{ .Values.config.device | default 0 | int | quote }}
{{- end -}}

{{- define "kvpool.tenantMount" -}}
- name: kvpool-run
  mountPath: {{ .Values.runDir }}
  readOnly: true
{{- end -}}

{{- define "kvpool.tenantVolume" -}}
- name: kvpool-run
  hostPath:
    path: {{ .Values.runDir }}
    type: Directory
{{- end -}}

{{- define "kvpool.tenantPodSecurity" -}}
runAsNonRoot: true
runAsUser: {{ .Values.tenant.uid | int }}
runAsGroup: {{ .Values.tenant.uid | int }}
supplementalGroups: [{{ .Values.daemon.gid | int }}]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kvpool.tenantContainerSecurity" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
{{- end -}}

{{- define "kvpool.envMap" -}}
{{- range $k, $v := . }}
- name: {{ $k }}
  value: {{ toString $v | quote }}
{{- end }}
{{- end -}}

{{/* The probe command: `kvpool SUBCOMMAND --run-dir RUN_DIR`. */}}
{{- define "kvpool.probe" -}}
exec:
  command: [kvpool, {{ .cmd }}, --json, --run-dir, {{ .root.Values.runDir | quote }}]
periodSeconds: {{ .p.periodSeconds }}
timeoutSeconds: {{ .p.timeoutSeconds }}
failureThreshold: {{ .p.failureThreshold }}
{{- end -}}
