{{/* Headless Service + StatefulSet of one node role: (dict "root" $ "role" "prefill|decode"). */}}
{{- define "baton.node" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $v := index $root.Values $role }}
{{- $labels := dict "root" $root "component" $role }}
{{- $sts := include "baton.stsName" . }}
{{- $svc := include "baton.headlessName" . }}
{{- $settings := include "baton.engineSettings" . | fromJson }}
apiVersion: v1
kind: Service
metadata:
  name: {{ $svc }}
  labels:
    {{- include "baton.componentLabels" $labels | nindent 4 }}
    baton.io/metrics: "true"
spec:
  clusterIP: None
  selector:
    {{- include "baton.componentSelectorLabels" $labels | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $v.ports.grpc }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    - name: http
      port: {{ $v.ports.http }}
      targetPort: http
      protocol: TCP
      appProtocol: http
    {{- if eq $role "prefill" }}
    - name: side-channel
      port: {{ $v.ports.sideChannel }}
      targetPort: side-channel
      protocol: TCP
    {{- end }}
---
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: {{ $sts }}
  labels:
    {{- include "baton.componentLabels" $labels | nindent 4 }}
spec:
  serviceName: {{ $svc }}
  {{- if not (and (eq $role "decode") $v.autoscaling.enabled) }}
  replicas: {{ $v.replicas }}
  {{- end }}
  # Nodes are independent: start and stop them all at once.
  podManagementPolicy: Parallel
  selector:
    matchLabels:
      {{- include "baton.componentSelectorLabels" $labels | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "baton.componentSelectorLabels" $labels | nindent 8 }}
      annotations:
        checksum/engine: {{ toJson $settings | sha256sum }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "baton.serviceAccountName" $root }}
      automountServiceAccountToken: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $root.Values.hostNetwork }}
      hostNetwork: true
      dnsPolicy: ClusterFirstWithHostNet
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      terminationGracePeriodSeconds: {{ include "baton.terminationGrace" (dict "v" $v "name" $role) }}
      containers:
        - name: {{ $role }}
          image: {{ include "baton.image" $root | quote }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: [{{ $root.Values.image.python | quote }}, "-m", {{ printf "baton.%s_node.server" $role | quote }}]
          args:
            - --model
            - {{ include "baton.modelPath" $root }}
            # Bind to the pod IP: the prefill node advertises its side-channel address to decode nodes.
            - --host
            - $(POD_IP)
            - --port
            - {{ $v.ports.grpc | quote }}
            - --http-port
            - {{ $v.ports.http | quote }}
            - --engine-id
            - $(POD_NAME)
            - --drain-timeout-s
            - {{ $v.drainTimeoutSeconds | quote }}
            {{- if eq $role "prefill" }}
            - --side-channel-port
            - {{ $v.ports.sideChannel | quote }}
            {{- if not (kindIs "invalid" $v.leaseSeconds) }}
            - --lease-seconds
            - {{ $v.leaseSeconds | quote }}
            {{- end }}
            {{- else }}
            {{- if not (kindIs "invalid" $v.readTimeout) }}
            - --read-timeout
            - {{ $v.readTimeout | quote }}
            {{- end }}
            {{- end }}
            {{- range $flag := keys $settings | sortAlpha }}
            - --{{ $flag }}
            - $({{ include "baton.engineKey" (dict "role" $role "flag" $flag) }})
            {{- end }}
            {{- range $v.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $v.ports.grpc }}
              protocol: TCP
            - name: http
              containerPort: {{ $v.ports.http }}
              protocol: TCP
            {{- if eq $role "prefill" }}
            - name: side-channel
              containerPort: {{ $v.ports.sideChannel }}
              protocol: TCP
            {{- end }}
          env:
            - name: POD_NAME
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            - name: POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            {{- include "baton.commonEnv" $root | nindent 12 }}
            {{- include "baton.clusterSecretEnv" $root | nindent 12 }}
            {{- range $flag := keys $settings | sortAlpha }}
            {{- $key := include "baton.engineKey" (dict "role" $role "flag" $flag) }}
            - name: {{ $key }}
              valueFrom:
                configMapKeyRef:
                  name: {{ include "baton.configMapName" $root }}
                  key: {{ $key }}
            {{- end }}
            {{- with $root.Values.ucx.tls }}
            - name: UCX_TLS
              value: {{ . | quote }}
            {{- end }}
            {{- with $root.Values.ucx.netDevices }}
            - name: UCX_NET_DEVICES
              value: {{ . | quote }}
            {{- end }}
            {{- range $name, $value := $root.Values.ucx.extraEnv }}
            - name: {{ $name }}
              value: {{ $value | toString | quote }}
            {{- end }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- include "baton.probes" (dict "root" $root) | nindent 10 }}
          {{- if gt (int $v.preStopSleepSeconds) 0 }}
          {{- include "baton.preStop" $v.preStopSleepSeconds | nindent 10 }}
          {{- end }}
          {{- $ranks := int (default 1 (index $settings "tensor-parallel-size")) }}
          {{- $gpu := dict $root.Values.gpu.resourceName (toString (mul (int $v.gpus) $ranks)) }}
          {{- if $root.Values.rdma.enabled }}
          {{- $_ := set $gpu $root.Values.rdma.resourceName (toString $root.Values.rdma.count) }}
          {{- end }}
          resources:
            requests:
              {{- toYaml (merge (deepCopy $gpu) (default dict $v.resources.requests)) | nindent 14 }}
            limits:
              {{- toYaml (merge (deepCopy $gpu) (default dict $v.resources.limits)) | nindent 14 }}
          securityContext:
            {{- $sc := deepCopy $root.Values.securityContext }}
            {{- if and $root.Values.rdma.enabled $root.Values.rdma.ipcLock }}
            {{- $caps := default dict $sc.capabilities }}
            {{- $_ := set $caps "add" (list "IPC_LOCK") }}
            {{- $_ := set $sc "capabilities" $caps }}
            {{- end }}
            {{- toYaml $sc | nindent 12 }}
          volumeMounts:
            - name: model
              mountPath: {{ $root.Values.model.mountPath }}
              readOnly: true
            - name: dshm
              mountPath: /dev/shm
            - name: tmp
              mountPath: /tmp
      volumes:
        {{- include "baton.modelVolume" $root | nindent 8 }}
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $root.Values.shm.sizeLimit }}
        - name: tmp
          emptyDir:
            sizeLimit: {{ $root.Values.tmp.sizeLimit }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}
