{{/* Names are cut so that StatefulSet pod names stay under the 63-character label limit. */}}
{{- define "baton.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "baton.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "baton.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "baton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "baton.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "baton.labels" -}}
helm.sh/chart: {{ include "baton.chart" . }}
{{ include "baton.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: baton
{{- end }}

{{/* Labels of one component: (dict "root" $ "component" "router|prefill|decode"). */}}
{{- define "baton.componentSelectorLabels" -}}
{{ include "baton.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "baton.componentLabels" -}}
{{ include "baton.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "baton.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "baton.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "baton.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "baton.modelPath" -}}
{{- if .Values.model.subPath }}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (trimPrefix "/" .Values.model.subPath) }}
{{- else }}
{{- .Values.model.mountPath }}
{{- end }}
{{- end }}

{{- define "baton.configMapName" -}}
{{- printf "%s-engine" (include "baton.fullname" .) }}
{{- end }}

{{/* StatefulSet and headless Service names of a node role: (dict "root" $ "role" "prefill|decode"). */}}
{{- define "baton.stsName" -}}
{{- printf "%s-%s" (include "baton.fullname" .root) .role }}
{{- end }}

{{- define "baton.headlessName" -}}
{{- printf "%s-%s-headless" (include "baton.fullname" .root) .role }}
{{- end }}

{{/* How many pod addresses the router is given for a role: replicas, or the HPA's maxReplicas. */}}
{{- define "baton.addressCount" -}}
{{- $v := index .root.Values .role }}
{{- if and (eq .role "decode") $v.autoscaling.enabled }}
{{- $v.autoscaling.maxReplicas }}
{{- else }}
{{- $v.replicas }}
{{- end }}
{{- end }}

{{/* Space-separated gRPC addresses of every pod of a role through its headless Service. */}}
{{- define "baton.workerAddresses" -}}
{{- $v := index .root.Values .role }}
{{- $sts := include "baton.stsName" . }}
{{- $svc := include "baton.headlessName" . }}
{{- $n := int (include "baton.addressCount" .) }}
{{- $out := list }}
{{- range $i := until $n }}
{{- $out = append $out (printf "%s-%d.%s.%s.svc.%s:%d" $sts $i $svc $.root.Release.Namespace $.root.Values.clusterDomain (int $v.ports.grpc)) }}
{{- end }}
{{- join " " $out }}
{{- end }}

{{/* NAME:PORT of a role's headless Service, for the router's DNS discovery (one A record per ready pod). */}}
{{- define "baton.workerDnsName" -}}
{{- $v := index .root.Values .role }}
{{- printf "%s.%s.svc.%s:%d" (include "baton.headlessName" .) .root.Release.Namespace .root.Values.clusterDomain (int $v.ports.grpc) }}
{{- end }}

{{/* Engine settings of a role (shared `engine` under the role's `engine`), as JSON; nulls dropped. */}}
{{- define "baton.engineSettings" -}}
{{- $v := index .root.Values .role }}
{{- $merged := mergeOverwrite (deepCopy .root.Values.engine) (deepCopy (default dict $v.engine)) }}
{{- $out := dict }}
{{- range $k, $val := $merged }}
{{- if not (kindIs "invalid" $val) }}
{{- $_ := set $out $k $val }}
{{- end }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* ConfigMap key of one engine flag of a role, e.g. BATON_DECODE_MAX_NUM_SEQS. */}}
{{- define "baton.engineKey" -}}
{{- printf "BATON_%s_%s" (upper .role) (.flag | replace "-" "_" | upper) }}
{{- end }}

{{/* The container's probes: startup and readiness on HTTP /health (503 while starting or draining), liveness on
/live (200 while the process serves, draining included): (dict "root" $). */}}
{{- define "baton.probes" -}}
{{- $p := .root.Values.probes }}
startupProbe:
  httpGet:
    path: /health
    port: http
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
  timeoutSeconds: {{ $p.startup.timeoutSeconds }}
readinessProbe:
  httpGet:
    path: /health
    port: http
  periodSeconds: {{ $p.readiness.periodSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
livenessProbe:
  httpGet:
    path: /live
    port: http
  periodSeconds: {{ $p.liveness.periodSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
{{- end }}

{{- define "baton.modelVolume" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
{{- else }}
{{- fail (printf "model.source must be pvc or hostPath, got %q" .Values.model.source) }}
{{- end }}
{{- end }}

{{- define "baton.commonEnv" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: PYTHONUNBUFFERED
  value: "1"
{{- end }}

{{- define "baton.preStop" -}}
lifecycle:
  preStop:
    sleep:
      seconds: {{ int . }}
{{- end }}

{{- define "baton.clusterSecretName" -}}
{{- default (printf "%s-cluster" (include "baton.fullname" .)) .Values.clusterSecret.existingSecret }}
{{- end }}

{{/* BATON_CLUSTER_SECRET from the cluster Secret (never on a command line). */}}
{{- define "baton.clusterSecretEnv" -}}
- name: BATON_CLUSTER_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "baton.clusterSecretName" . }}
      key: {{ .Values.clusterSecret.key }}
{{- end }}

{{/* terminationGracePeriodSeconds of a component (its values as .v, its path as .name): the value given, else
its drain + preStop sleep + 15 s for the rest of its shutdown; a value below drain + preStop is refused. */}}
{{- define "baton.terminationGrace" -}}
{{- $v := .v }}
{{- if hasKey $v "grace" }}
{{- fail (printf "%s.grace was renamed %s.drainTimeoutSeconds" .name .name) }}
{{- end }}
{{- $drain := int (ceil $v.drainTimeoutSeconds) }}
{{- $pre := int $v.preStopSleepSeconds }}
{{- if kindIs "invalid" $v.terminationGracePeriodSeconds }}
{{- add $drain $pre 15 }}
{{- else if lt (int $v.terminationGracePeriodSeconds) (add $drain $pre) }}
{{- fail (printf "%s.terminationGracePeriodSeconds must be at least drainTimeoutSeconds + preStopSleepSeconds (%d), got %d" .name (add $drain $pre) (int $v.terminationGracePeriodSeconds)) }}
{{- else }}
{{- $v.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}
