{{/*
GPU access: the device plugin ("" mode) or DRA (shared, consumable). docs/KUBERNETES.md
"GPU access: device plugin or DRA".

kvpool.dra.mode: the checked mode. Every template whose output depends on it calls this,
so a malformed combination of values fails `helm template` with one line naming the
value to change, whichever template Helm renders first.
*/}}
{{- define "kvpool.dra.mode" -}}
{{- $v := .Values -}}
{{- $d := $v.dra -}}
{{- $mode := toString ($d.mode | default "") -}}
{{- if not (has $mode (list "" "shared" "consumable")) -}}
{{- fail (printf "dra.mode %q: one of \"\" (the device plugin), shared, consumable" $mode) -}}
{{- end -}}
{{- $res := $v.devicePlugin.resource | default "" -}}
{{- $tenants := list (list "vllm" $v.vllm) (list "server" $v.server) (list "training" $v.training) -}}
{{- $shared := $d.shared.nodes | default list -}}
{{- if and $shared (ne $mode "shared") -}}
{{- fail (printf "dra.shared.nodes is set but dra.mode is %q: the per-node claims are dra.mode=shared's" $mode) -}}
{{- end -}}
{{- if and $d.consumable.tenants (ne $mode "consumable") -}}
{{- fail (printf "dra.consumable.tenants is set but dra.mode is %q: claims of memory are dra.mode=consumable's" $mode) -}}
{{- end -}}
{{- range $tenants }}
{{- $key := index . 0 }}{{ $t := index . 1 -}}
{{- if and $t.enabled $t.node (ne $mode "shared") -}}
{{- fail (printf "%s.node is set but dra.mode is %q: a tenant's node picks a dra.mode=shared claim" $key $mode) -}}
{{- end -}}
{{- if and $t.enabled $t.min (ne $mode "consumable") -}}
{{- fail (printf "%s.min is set but dra.mode is %q: it is the claim of dra.mode=consumable (otherwise set %s.env.KVPOOL_MIN)" $key $mode $key) -}}
{{- end -}}
{{- end -}}
{{- if $mode -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$" (toString ($d.deviceClassName | default ""))) -}}
{{- fail (printf "dra.deviceClassName %q: dra.mode=%s claims devices of a DeviceClass; name it (lowercase letters, digits, '-' and '.')" (toString ($d.deviceClassName | default "")) $mode) -}}
{{- end -}}
{{- $holders := list (list "daemon" $v.daemon true) -}}
{{- range $tenants }}{{ $holders = append $holders (list (index . 0) (index . 1) (index . 1).enabled) }}{{ end -}}
{{- range $holders }}
{{- $key := index . 0 }}{{ $t := index . 1 }}{{ $on := index . 2 -}}
{{- range $kind := list "limits" "requests" }}
{{- if and $on $res (hasKey (get ($t.resources | default dict) $kind | default dict) $res) -}}
{{- fail (printf "%s.resources.%s.%s: dra.mode=%s gives the GPU through a ResourceClaim; drop the device plugin's resource (it would take a GPU a second time)" $key $kind $res $mode) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if eq $mode "shared" -}}
{{- if not $shared -}}
{{- fail "dra.shared.nodes is empty: dra.mode=shared makes one named ResourceClaim and one daemon per GPU node (a named claim is allocated on one node); list the nodes" -}}
{{- end -}}
{{- range $shared }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$" (toString .)) -}}
{{- fail (printf "dra.shared.nodes: %q is not a node name (lowercase letters, digits, '-' and '.')" (toString .)) -}}
{{- end -}}
{{- if gt (len (printf "%s-gpu-%s" (include "kvpool.fullname" $) .)) 63 -}}
{{- fail (printf "dra.shared.nodes: %q makes the claim name %s-gpu-%s longer than 63 characters" . (include "kvpool.fullname" $) .) -}}
{{- end -}}
{{- end -}}
{{- if ne (len $shared) (len (uniq $shared)) -}}
{{- fail "dra.shared.nodes names a node twice: one claim and one daemon per node" -}}
{{- end -}}
{{- $am := toString $d.shared.allocationMode -}}
{{- if not (has $am (list "ExactCount" "All")) -}}
{{- fail (printf "dra.shared.allocationMode %q: ExactCount (dra.shared.count GPUs) or All" $am) -}}
{{- end -}}
{{- if and (eq $am "ExactCount") (lt (int $d.shared.count) 1) -}}
{{- fail (printf "dra.shared.count %v: at least 1 GPU per node" $d.shared.count) -}}
{{- end -}}
{{- range $tenants }}
{{- $key := index . 0 }}{{ $t := index . 1 -}}
{{- if and $t.enabled $t.node (not (has (toString $t.node) $shared)) -}}
{{- fail (printf "%s.node %q is not in dra.shared.nodes (%s): its claim would not exist" $key (toString $t.node) (join ", " $shared)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if eq $mode "consumable" -}}
{{- $names := dict -}}
{{- range $tenants }}
{{- $key := index . 0 }}{{ $t := index . 1 -}}
{{- if $t.enabled -}}
{{- $field := ternary "lease" "min" (eq $key "training") -}}
{{- $q := get $t $field -}}
{{- if not $q -}}
{{- fail (printf "%s.%s is not set: in dra.mode=consumable each tenant pod claims its guaranteed minimum (e.g. 8Gi), which becomes its KVPOOL_MIN" $key $field) -}}
{{- end -}}
{{- include "kvpool.dra.checkQuantity" (dict "what" (printf "%s.%s" $key $field) "q" $q) -}}
{{- if hasKey ($t.env | default dict) "KVPOOL_MIN" -}}
{{- fail (printf "%s.env.KVPOOL_MIN: in dra.mode=consumable KVPOOL_MIN is %s.%s, the claim's memory; drop it from env" $key $key $field) -}}
{{- end -}}
{{- $name := include "kvpool.dra.tenantName" (list $key $t) -}}
{{- $_ := set $names $name (printf "%s.%s" $key (ternary "servedModelName" "name" (eq $key "vllm"))) -}}
{{- end -}}
{{- end -}}
{{- range $name, $t := $d.consumable.tenants }}
{{- if not (kindIs "map" $t) -}}
{{- fail (printf "dra.consumable.tenants.%s: a map {namespace: NS, min: QUANTITY}" $name) -}}
{{- end -}}
{{- $unknown := without (keys $t) "namespace" "min" -}}
{{- if $unknown -}}
{{- fail (printf "dra.consumable.tenants.%s: unknown keys %s (namespace, min)" $name (join ", " (sortAlpha $unknown))) -}}
{{- end -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" (toString $t.namespace)) -}}
{{- fail (printf "dra.consumable.tenants.%s.namespace %q: the namespace of its pods (a DNS label)" $name (toString ($t.namespace | default ""))) -}}
{{- end -}}
{{- if not $t.min -}}
{{- fail (printf "dra.consumable.tenants.%s.min is not set: the memory its pods claim and get as their minimum" $name) -}}
{{- end -}}
{{- include "kvpool.dra.checkQuantity" (dict "what" (printf "dra.consumable.tenants.%s.min" $name) "q" $t.min) -}}
{{- if hasKey $names $name -}}
{{- fail (printf "dra.consumable.tenants.%s: %s names the same tenant; one claim per tenant" $name (get $names $name)) -}}
{{- end -}}
{{- $_ := set $names $name (printf "dra.consumable.tenants.%s" $name) -}}
{{- end -}}
{{- range $name, $where := $names }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" $name) -}}
{{- fail (printf "%s %q: in dra.mode=consumable the tenant name names its ResourceClaimTemplate: lowercase letters, digits and '-'" $where $name) -}}
{{- end -}}
{{- if gt (len (printf "%s-%s" (include "kvpool.fullname" $) $name)) 63 -}}
{{- fail (printf "%s %q: the ResourceClaimTemplate name %s-%s is longer than 63 characters" $where $name (include "kvpool.fullname" $) $name) -}}
{{- end -}}
{{- $conf := get ($v.config.tenants | default dict) $name -}}
{{- if and (kindIs "map" $conf) (not (kindIs "invalid" (get $conf "min"))) (hasKey $conf "min") -}}
{{- fail (printf "config.tenants.%s.min: in dra.mode=consumable the tenant's minimum is its claim (%s), and a configured min would override it; drop it" $name $where) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $mode -}}
{{- end -}}

{{/* A quantity the claim and KVPOOL_MIN both take: whole bytes or a binary suffix. */}}
{{- define "kvpool.dra.checkQuantity" -}}
{{- $q := include "kvpool.dra.quantity" .q -}}
{{- if or (not (regexMatch "^[0-9]+(Ki|Mi|Gi|Ti)?$" $q)) (regexMatch "^0+[KMGT]?i?$" $q) -}}
{{- fail (printf "%s %q: a positive whole number of bytes or of Ki, Mi, Gi, Ti (8Gi): the same amount is the claim's memory and the tenant's KVPOOL_MIN, and decimal or fractional units (8G, 1.5Gi, 40%%) read differently in the two" .what $q) -}}
{{- end -}}
{{- end -}}

{{/* A quantity value as text (Helm reads a YAML number as a float). */}}
{{- define "kvpool.dra.quantity" -}}
{{- if or (kindIs "float64" .) (kindIs "int" .) (kindIs "int64" .) -}}
{{- if eq (float64 (int64 .)) (float64 .) -}}{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end -}}

{{/* The bytes of a checked quantity (8Gi -> 8589934592): KVPOOL_MIN, the lease. */}}
{{- define "kvpool.dra.bytes" -}}
{{- $q := include "kvpool.dra.quantity" . -}}
{{- $unit := regexFind "[KMGT]i$" $q -}}
{{- $n := atoi (trimSuffix $unit $q) -}}
{{- $factor := get (dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776) $unit -}}
{{- mul $n $factor -}}
{{- end -}}

{{/* An example tenant's kvpool name, from (list KEY VALUES). */}}
{{- define "kvpool.dra.tenantName" -}}
{{- $key := index . 0 }}{{ $t := index . 1 -}}
{{- if eq $key "vllm" }}{{ $t.servedModelName }}{{ else }}{{ $t.name }}{{ end -}}
{{- end -}}

{{/*
The consumable claims as a JSON list of {namespace, template, tenant, quantity, bytes}:
the example tenants' (release namespace) and dra.consumable.tenants'. The templates,
the tenant pods and the admission policy all read this one list.
*/}}
{{- define "kvpool.dra.claims" -}}
{{- $out := list -}}
{{- $full := include "kvpool.fullname" . -}}
{{- $v := .Values -}}
{{- range $key := list "vllm" "server" "training" }}
{{- $t := get $v $key -}}
{{- if $t.enabled -}}
{{- $name := include "kvpool.dra.tenantName" (list $key $t) -}}
{{- $q := include "kvpool.dra.quantity" (ternary $t.lease $t.min (eq $key "training")) -}}
{{- $out = append $out (dict "namespace" $.Release.Namespace "template" (printf "%s-%s" $full $name) "tenant" $name "quantity" $q "bytes" (include "kvpool.dra.bytes" $q)) -}}
{{- end -}}
{{- end -}}
{{- range $name, $t := $v.dra.consumable.tenants }}
{{- $q := include "kvpool.dra.quantity" $t.min -}}
{{- $out = append $out (dict "namespace" $t.namespace "template" (printf "%s-%s" $full $name) "tenant" $name "quantity" $q "bytes" (include "kvpool.dra.bytes" $q)) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/*
A tenant pod's claim of the GPU, from (dict "root" $ "key" KEY "t" VALUES): the pod's
resourceClaims entry, nothing in the device-plugin mode.
*/}}
{{- define "kvpool.dra.podClaims" -}}
{{- $mode := include "kvpool.dra.mode" .root -}}
{{- $full := include "kvpool.fullname" .root -}}
{{- if eq $mode "shared" }}
resourceClaims:
  - name: gpu
    resourceClaimName: {{ printf "%s-gpu-%s" $full (include "kvpool.dra.node" .) }}
{{- else if eq $mode "consumable" }}
resourceClaims:
  - name: gpu
    resourceClaimTemplateName: {{ printf "%s-%s" $full (include "kvpool.dra.tenantName" (list .key .t)) }}
{{- end }}
{{- end -}}

{{/* The node of a tenant in dra.mode=shared: its `node`, else the first listed. */}}
{{- define "kvpool.dra.node" -}}
{{- .t.node | default (first .root.Values.dra.shared.nodes) -}}
{{- end -}}

{{/*
A tenant container's resources, from (dict "root" $ "key" KEY "t" VALUES): its
`resources`, plus devicePlugin.resource: 1 in the device-plugin mode (unless it asks a
count itself), or the pod's claim in a DRA mode.
*/}}
{{- define "kvpool.tenantResources" -}}
{{- $mode := include "kvpool.dra.mode" .root -}}
{{- $r := deepCopy (.t.resources | default dict) -}}
{{- $res := .root.Values.devicePlugin.resource | default "" -}}
{{- if and (eq $mode "") $res -}}
{{- $limits := $r.limits | default dict -}}
{{- if not (hasKey $limits $res) }}{{ $_ := set $limits $res 1 }}{{ end -}}
{{- $_ := set $r "limits" $limits -}}
{{- else if $mode -}}
{{- $_ := set $r "claims" (list (dict "name" "gpu")) -}}
{{- end -}}
{{- toYaml $r -}}
{{- end -}}

{{/*
A tenant pod's nodeSelector, from (dict "root" $ "key" KEY "t" VALUES): the daemon's
nodes, and in dra.mode=shared the node whose claim it references.
*/}}
{{- define "kvpool.tenantNodeSelector" -}}
{{- $sel := deepCopy (.root.Values.daemon.nodeSelector | default dict) -}}
{{- if eq (include "kvpool.dra.mode" .root) "shared" -}}
{{- $_ := set $sel "kubernetes.io/hostname" (include "kvpool.dra.node" .) -}}
{{- end -}}
{{- with $sel }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
Replicas of one tenant name on different nodes, from (dict "root" $ "component" C
"replicas" N): a daemon holds one session per tenant name, so two replicas on one node
would have the second refused.
*/}}
{{- define "kvpool.tenantSpread" -}}
{{- if gt (int .replicas) 1 }}
affinity:
  podAntiAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      - topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            app.kubernetes.io/instance: {{ .root.Release.Name }}
            app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end -}}
